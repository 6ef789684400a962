"""Download (optional) and tokenize TinyStories into llm.c-format shards.

    python data/tinystories.py --download                 # ~1.5 GB tarball, then tokenize
    python data/tinystories.py --input DIR_OR_TARBALL      # already downloaded

The first JSON file becomes TinyStories_val.bin, the rest TinyStories_train_*.bin.
"""

import argparse
import sys
from pathlib import Path

from llama.data.datasets import prepare_tinystories
from llama.data.download import DownloadError, download
from llama.data.tokenizer import TokenizerError, load_tokenizer

URL = "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/TinyStories_all_data.tar.gz"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", default="data/tinystories/TinyStories_all_data.tar.gz",
                        help="folder of data*.json files, or the tarball")
    parser.add_argument("--download", action="store_true", help="download the tarball to --input first")
    parser.add_argument("--out-dir", default="data/tinystories", help="where the shards go")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.model (default: data/tokenizer/, else bytes)")
    args = parser.parse_args(argv)
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        if args.download:
            download(URL, args.input)
        shards = prepare_tinystories(Path(args.input), args.out_dir, tokenizer)
    except (OSError, TokenizerError, DownloadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {len(shards)} shards to {args.out_dir} (vocab {tokenizer.vocab_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
