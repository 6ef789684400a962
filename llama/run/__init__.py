"""A training run: what runs where, decided once (plan.py), what it needs of the machine's memory (memory.py), and
the run itself (trainer.py), which train_llama.py drives."""
