"""Download the Llama 3 tokenizer (from Meta's llama-models wheel on the Python package index, or
with --hf-token from the gated Hugging Face repository) and tinyshakespeare, and tokenize the text
into tinyshakespeare/*.bin, all in the per-user cache (~/.cache/llama-cuda; $LLAMA_CUDA_CACHE moves it).

    python3 scripts/download_starter_pack.py [--tokenizer-wheel FILE | --index-url URL | --hf-token hf_...]
                                            [--dest FOLDER] [--base-url MIRROR]
"""

import sys

from llama.data.starter_pack import main

if __name__ == "__main__":
    sys.exit(main())
