"""The kernel ladders in llm.c's dev/cuda style: every rung the plan does not pick, with its launchers, runners and
tests (python3 -m pytest dev/cuda); what each rung measured is in README.md."""
