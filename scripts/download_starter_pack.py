"""Download the Llama 3 tokenizer (needs --hf-token or HF_TOKEN) and tinyshakespeare, and tokenize
the text into data/tinyshakespeare/*.bin.

    python scripts/download_starter_pack.py [--hf-token hf_...] [--dest data] [--base-url MIRROR]
"""

import sys

from llama.starter_pack import main

if __name__ == "__main__":
    sys.exit(main())
