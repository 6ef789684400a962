"""Download (optional) and tokenize TinyStories with scripts/prepare_data.py's code.

    python data/tinystories.py --download                 # ~1.5 GB tarball, then tokenize
    python data/tinystories.py --input DIR_OR_TARBALL      # already downloaded

The tarball is unpacked beside itself; each story of its data*.json files is a document, framed
<|begin_of_text|> ... <|end_of_text|>, every 100th in TinyStories_val_*.bin, the rest in
TinyStories_train_*.bin (shards of 100M tokens).
"""

import argparse
import os
import sys
import tarfile
from pathlib import Path

from llama.runtime.cli import positive_int
from llama.data.download import DownloadError, download
from llama.data.prepare import PrepareError, PrepareOptions, prepare_dataset
from llama.data.tokenizer import TokenizerError, load_tokenizer

URL = "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/TinyStories_all_data.tar.gz"


def unpacked(source: Path) -> Path:
    """The folder of data*.json files: source itself, or the tarball unpacked beside it (once)."""
    if source.is_dir():
        return source
    folder = source.with_name(source.name.removesuffix(".tar.gz"))
    done = folder / ".unpacked"
    if not done.exists():
        with tarfile.open(source) as tar:
            extract_files(tar, folder)
        done.touch()
    return folder


def extract_files(tar: tarfile.TarFile, folder: Path) -> None:
    """The tarball's files into folder, none outside it: tarfile's "data" filter, or on a Python without
    extraction filters (before 3.11.4 and 3.10.12) its regular files alone, each path checked."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(folder, filter="data")
        return
    for member in tar.getmembers():
        if Path(member.name).is_absolute() or ".." in Path(member.name).parts:
            raise tarfile.TarError(f"{member.name}: a path outside the folder it is unpacked into")
        if member.isfile():
            tar.extract(member, folder)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", default="data/tinystories/TinyStories_all_data.tar.gz",
                        help="folder of data*.json files, or the tarball")
    parser.add_argument("--download", action="store_true", help="download the tarball to --input first")
    parser.add_argument("--out-dir", default="data/tinystories", help="where the shards go")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.model (default: the Llama 3 tokenizer in the per-user cache, "
                        "else bytes)")
    parser.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1, help="tokenizing processes")
    args = parser.parse_args(argv)
    options = PrepareOptions("TinyStories", Path(args.out_dir), text_field="story", workers=args.workers,
                             overwrite=True)
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        if args.download:
            download(URL, args.input)
        summary = prepare_dataset([str(unpacked(Path(args.input)))], tokenizer, options)
    except (OSError, tarfile.TarError, TokenizerError, DownloadError, PrepareError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for line in summary.lines():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
