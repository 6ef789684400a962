"""Development material beside the package: dev/cuda holds the kernel ladders (README.md there)."""
