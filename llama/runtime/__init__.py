"""What every command runs on, knowing nothing of Llama: the CUDA runtime and the kernels' build (cuda.py,
kernel_build.py), launch timing (timeline.py), page-locked host memory (pinned.py), the machine's free memory
(machine.py), signals (signals.py), the progress display (progress.py) and the command line's value types (cli.py)."""
