"""Tokenize your own documents into llm.c token shards for train_llama.py.

    python3 scripts/prepare_data.py my_texts/ --name mine                     # a folder of .txt files
    python3 scripts/prepare_data.py 'corpus/*.jsonl' --name web --text-field content
    python3 scripts/prepare_data.py chats.jsonl --name chat                   # {"messages": [...]} per line
    python3 scripts/prepare_data.py fineweb/*.parquet --name fineweb          # needs pyarrow

A .txt file is a document; a .jsonl line is a document (its --text-field) or a conversation
({"messages": [{"role": ..., "content": ...}]}, rendered in the Llama 3 chat format with a loss mask
sidecar); a .json file's array items are documents as JSONL lines are; a .parquet row is a document. Every document is framed <|begin_of_text|> ... <|end_of_text|>,
the first and every --val-every-th document go to the validation split, and the shards land in
OUT_DIR (default data/NAME) as NAME_train_000000.bin, NAME_val_000000.bin, ..., with NAME.manifest.json
written last: the trainer uses a prepared dataset only whole. The shards are written aside and moved into
place at the end, so that a failure, Ctrl-C or a kill leaves OUT_DIR as it was (with --overwrite, the
dataset there too). A bad record stops the run with its file and line (exit 2) unless --skip-bad; an
empty document is skipped and named. docs/data.md has the formats.
"""

import argparse
import os
import sys
from pathlib import Path

from llama.runtime.cli import ArgumentParser, HelpFormatter, nonnegative_int, positive_int
from llama.data.prepare import PrepareError, PrepareOptions, prepare_dataset
from llama.data.shards import ShardError
from llama.data.tokenizer import TokenizerError, load_tokenizer


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("inputs", nargs="+", help=".txt, .jsonl, .json or .parquet files, folders of them, or globs")
    p.add_argument("--name", default=None, help="the dataset's name, the shards' prefix (default: the first "
                   "input's name)")
    p.add_argument("--out-dir", default=None, help="where the shards go (default: data/NAME)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.model or tokenizer.json (default: "
                   "tokenizer/tokenizer.model in the per-user cache, fetched if missing, else bytes)")
    p.add_argument("--text-field", default="text", help="the JSONL field or parquet column holding the text")
    p.add_argument("--shard-tokens", type=positive_int, default=100_000_000, help="tokens per shard")
    p.add_argument("--val-every", type=nonnegative_int, default=100,
                   help="the first and every N-th document go to validation; 0: no validation split")
    p.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1, help="tokenizing processes")
    p.add_argument("--skip-bad", action="store_true", help="skip bad records (counted in the summary) "
                   "instead of stopping at the first")
    p.add_argument("--overwrite", action="store_true", help="replace shards of the same name in OUT_DIR")
    args = p.parse_args(argv)
    if args.val_every == 1:
        p.error("--val-every 1 would put every document in validation; use 0 for no split, or N >= 2")
    args.name = args.name or Path(args.inputs[0].rstrip("/*")).stem or "dataset"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir or Path("data") / args.name)
    options = PrepareOptions(args.name, out_dir, args.text_field, args.shard_tokens, args.val_every,
                             args.workers, args.skip_bad, args.overwrite)
    try:
        tokenizer = load_tokenizer(args.tokenizer, fetch=True)
        summary = prepare_dataset(args.inputs, tokenizer, options)
    except (PrepareError, TokenizerError, ShardError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: {out_dir} is as it was", file=sys.stderr)
        return 130
    for line in summary.lines():
        print(line)
    print("train with: " + train_command(out_dir, args.name, bool(summary.writers["val"].paths), summary.chat,
                                         args.tokenizer))
    return 0


def train_command(out_dir: Path, name: str, val: bool, chat: bool, tokenizer: str | None) -> str:
    """The trainer's command for the dataset: its splits, and for chat data --sft (with the tokenizer given)."""
    return (f"python3 train_llama.py -i '{out_dir}/{name}_train_*.bin'" + (f" -j '{out_dir}/{name}_val_*.bin'" if val
                                                                          else "")
            + (" --sft" if chat else "") + (f" --tokenizer {tokenizer}" if tokenizer else ""))


if __name__ == "__main__":
    sys.exit(main())
