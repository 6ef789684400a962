"""Tokenize tinyshakespeare (char-rnn's input.txt) into llm.c-format shards.

    python data/tinyshakespeare.py --input data/tinyshakespeare/input.txt [--tokenizer PATH]

The starter pack (scripts/download_starter_pack.py) downloads input.txt and runs this for you.
"""

import argparse
import sys

from llama.data.datasets import CorpusError, prepare_tinyshakespeare
from llama.data.tokenizer import TokenizerError, load_tokenizer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", default="data/tinyshakespeare/input.txt", help="the text file")
    parser.add_argument("--out-dir", default="data/tinyshakespeare", help="where the shards go")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.model (default: data/tokenizer/, else bytes)")
    args = parser.parse_args(argv)
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        train, val = prepare_tinyshakespeare(args.input, args.out_dir, tokenizer)
    except (OSError, CorpusError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {train} and {val} (vocab {tokenizer.vocab_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
