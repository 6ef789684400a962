"""`python3 -m llama.launch`: start one training process per GPU (the launcher is llama/parallel/launch.py)."""

import sys

from llama.parallel.launch import main

if __name__ == "__main__":
    sys.exit(main())
