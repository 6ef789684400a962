"""Evaluation on multiple-choice tasks, scored as lm-evaluation-harness scores them: tasks.py (HellaSwag,
a user's JSONL), scoring.py (the requests, passes and metrics), runner.py (a task on a model)."""
