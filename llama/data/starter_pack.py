"""The starter pack: the Llama 3 tokenizer and tinyshakespeare, downloaded and tokenized into shards
in the per-user cache (llama/cache.py; --dest elsewhere), where the trainer and the scripts find
them from any folder. The tokenizer comes from Meta's llama-models wheel on the Python package index (no
account needed), or with --hf-token from the gated Hugging Face repository. Run it as
scripts/download_starter_pack.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..runtime.cli import ArgumentParser, nonnegative_int, positive_float
from ..cache import CACHE_VARIABLE, cache_dir
from .datasets import prepare_tinyshakespeare, starter_pack_shards
from .download import GATED_HELP, DownloadError, download
from .shards import ShardError, read_header
from .tokenizer import ByteTokenizer, Llama3Tokenizer
from .tokenizer_fetch import LLAMA3_TOKENIZER, FetchError, fetch_llama3_tokenizer

TOKENIZER = dict(base="https://huggingface.co", path="meta-llama/Llama-3.1-8B/resolve/main/original/tokenizer.model",
                 dest="tokenizer/tokenizer.model", **LLAMA3_TOKENIZER)
TINYSHAKESPEARE = dict(base="https://raw.githubusercontent.com",
                       path="karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
                       dest="tinyshakespeare/input.txt", size=1_115_394,
                       sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed")


def fetch(spec: dict, args, dest: Path, **kwargs) -> Path:
    url = f"{(args.base_url or spec['base']).rstrip('/')}/{spec['path']}"
    return download(url, dest / spec["dest"], size=spec["size"], sha256=spec["sha256"],
                    retries=args.retries, timeout=args.timeout, **kwargs)


def shards_match(paths, vocab_size: int) -> bool:
    try:
        return all(read_header(p).vocab_size == vocab_size for p in paths)
    except ShardError:
        return False


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--hf-token", default=os.environ.get("HF_TOKEN"),
                        help="get the tokenizer from the gated Hugging Face repository with this access token "
                             "instead of the llama-models wheel (default: $HF_TOKEN)")
    parser.add_argument("--tokenizer-wheel", default=None,
                        help="a llama-models 0.3.0 wheel file already on disk to take the tokenizer from")
    parser.add_argument("--index-url", default=None,
                        help="the package index pip downloads the llama-models wheel from (default: pip's own)")
    parser.add_argument("--base-url", default=None,
                        help="a mirror that serves every file under the same path as its origin")
    parser.add_argument("--dest", default=None, help=f"download and output folder (default: the per-user cache, now "
                        f"{cache_dir()}; ${CACHE_VARIABLE} moves it)")
    parser.add_argument("--retries", type=nonnegative_int, default=5, help="retries per file on network errors")
    parser.add_argument("--timeout", type=positive_float, default=30.0, help="seconds before a stalled request fails")
    args = parser.parse_args(argv)
    dest = Path(args.dest) if args.dest is not None else cache_dir()
    try:
        tokenizer_path = dest / TOKENIZER["dest"]
        if args.hf_token:
            fetch(TOKENIZER, args, dest, headers={"Authorization": f"Bearer {args.hf_token}"}, gated=True)
        else:
            try:
                fetch_llama3_tokenizer(tokenizer_path, wheel=args.tokenizer_wheel, index_url=args.index_url,
                                       timeout=args.timeout, retries=args.retries)
                print(f"Llama 3 tokenizer: {tokenizer_path} (from the llama-models wheel)")
            except FetchError as e:
                if args.tokenizer_wheel:  # the file asked for is unusable: no quiet fallback to bytes
                    raise
                print(f"could not get the Llama 3 tokenizer from the llama-models wheel: {e}\n"
                      "Alternatively: " + GATED_HELP + "\nThe data is tokenized with the byte-level tokenizer "
                      "instead.", file=sys.stderr)
        text = fetch(TINYSHAKESPEARE, args, dest)
        tokenizer = Llama3Tokenizer(tokenizer_path) if tokenizer_path.exists() else ByteTokenizer()
        shards = starter_pack_shards(dest)
        if shards_match(shards, tokenizer.vocab_size):
            print(f"shards in {shards[0].parent} are up to date (vocab {tokenizer.vocab_size})")
        else:
            prepare_tinyshakespeare(text, shards[0].parent, tokenizer)
            print(f"wrote {shards[0]} and {shards[1]} (vocab {tokenizer.vocab_size})")
    except (DownloadError, FetchError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # downloads and shards are written atomically: nothing half-written stays
        print(f"\ninterrupted; what was finished is kept in {dest}: run it again to complete the rest",
              file=sys.stderr)
        return 130
    return 0
