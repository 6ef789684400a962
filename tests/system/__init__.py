"""Whole-program tests on the CPU: train_llama.py end to end, checkpoints, signals, launch, downloads, nvcc, packaging."""
