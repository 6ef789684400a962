"""GPU tests (`gpu` marker): kernels, models, decoder and training on CUDA; skipped where there is no GPU."""
