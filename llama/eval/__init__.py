"""Benchmarks scored as lm-evaluation-harness 0.4 scores them: items.py (items and tasks), files.py (where a task's
file comes from), benchmarks.py (the ten standard tasks: their files and prompts), tasks.py (tasks by name, the
suite, a user's JSONL), scoring.py (the requests, passes and metrics), runner.py (tasks on a model), results.py
(lm-eval's results JSON)."""
