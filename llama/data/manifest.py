"""A prepared dataset is whole or it is not used: its manifest, written last, lists every shard.

scripts/prepare_data.py writes NAME_train_000000.bin, ..., NAME_val_000000.bin, ... (with their .mask.bin
loss masks for chat data) and then NAME.manifest.json beside them: for each split, every shard's file name,
tokens and, for chat data, the tokens its mask counts. Each such shard says in its header that a manifest
lists it (llama/data/shards.py), so that the data loader (check_listed) refuses one whose manifest is
missing, does not list it, or lists a shard or sidecar of its split that is missing or cut short: a
preparation killed halfway, or a dataset copied in part. Shards without the mark (llm.c's, the starter
pack's, the built-in corpus's, datasets prepared before manifests existed) are used as they are.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .shards import HEADER_BYTES, ShardError, ShardInfo, mask_path

MANIFEST_SUFFIX = ".manifest.json"
FORMAT = "llama-cuda dataset 1"
SHARD_NAME = re.compile(r"^(?P<name>.+)_(?P<split>train|val)_(?P<index>\d{6})\.bin$")
PARTIAL = ".{name}.partial"  # the folder, beside the dataset, where a preparation writes until it is whole


def manifest_path(folder: str | Path, name: str) -> Path:
    return Path(folder) / f"{name}{MANIFEST_SUFFIX}"


def write_manifest(path: Path, contents: dict) -> None:
    """The manifest, written atomically (a temporary file fsynced, then renamed into place)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            json.dump({"format": FORMAT, **contents}, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_manifest(path: Path) -> dict:
    """A manifest's contents; ShardError when it cannot be read or is not one."""
    try:
        contents = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ShardError(f"cannot read the dataset manifest {path}: {getattr(e, 'strerror', None) or e}") from None
    splits = contents.get("splits") if isinstance(contents, dict) else None
    if contents.get("format") != FORMAT or not isinstance(splits, dict) or not all(
            isinstance(entry, dict) and isinstance(entry.get("file"), str) and isinstance(entry.get("tokens"), int)
            for entries in splits.values() for entry in entries):
        raise ShardError(f"{path} is not a dataset manifest of this version ({FORMAT})")
    return contents


def again(folder: Path, name: str) -> str:
    """What to do about a dataset that is not whole."""
    return (f"prepare it again: python3 scripts/prepare_data.py INPUTS --name {name} --out-dir {folder} "
            "--overwrite")


def check_listed(shards: list[ShardInfo]) -> dict[Path, dict]:
    """Every shard whose header says a manifest lists it, against that manifest, and every shard and sidecar of
    its split that the manifest lists, by size (nothing else is read); {shard path: its manifest entry}.
    ShardError, naming the file and what to run, when the dataset is not whole."""
    datasets: dict[tuple[Path, str], list[ShardInfo]] = {}
    for info in shards:
        if info.listed:
            match = SHARD_NAME.match(info.path.name)
            if match is None:
                raise ShardError(f"{info.path}: a shard of a prepared dataset under another name than "
                                 "NAME_train_NNNNNN.bin or NAME_val_NNNNNN.bin, which its manifest knows it by")
            datasets.setdefault((info.path.parent, match["name"]), []).append(info)
    entries = {}
    for (folder, name), infos in datasets.items():
        path = manifest_path(folder, name)
        if not path.exists():
            raise ShardError(f"{folder} holds shards of {name} but not its manifest {path.name}, which "
                             "scripts/prepare_data.py writes last: the preparation did not finish, or the folder "
                             f"was copied in part; {again(folder, name)}")
        manifest = read_manifest(path)
        listed = {entry["file"]: (split, entry) for split, split_entries in manifest["splits"].items()
                  for entry in split_entries}
        for info in infos:
            split, entry = listed.get(info.path.name, (None, None))
            if entry is None or entry["tokens"] != info.num_tokens:
                raise ShardError(f"{info.path} is not a shard that {path.name} lists"
                                 + ("" if entry is None else f" (it lists {entry['tokens']} tokens, the file holds "
                                                             f"{info.num_tokens})") + f"; {again(folder, name)}")
            entries[info.path] = entry
        for split in {listed[info.path.name][0] for info in infos}:
            _check_split(folder, name, manifest["splits"][split], bool(manifest.get("chat")), path)
    return entries


def _check_split(folder: Path, name: str, split_entries: list[dict], chat: bool, manifest: Path) -> None:
    """Every shard (and, for chat data, loss mask) of a split that the manifest lists is there, of its size."""
    for entry in split_entries:
        shard = folder / entry["file"]
        files = [(shard, HEADER_BYTES + 4 * entry["tokens"], "shard")]
        if chat:
            files.append((mask_path(shard), HEADER_BYTES + entry["tokens"], "loss mask"))
        for file, size, what in files:
            if not file.is_file():
                owner = f"{shard} has no loss mask ({file.name})" if what == "loss mask" else f"{file} is missing"
                raise ShardError(f"{owner}, which {manifest.name} lists: the dataset is not whole; "
                                 f"{again(folder, name)}")
            if file.stat().st_size != size:
                raise ShardError(f"{file}: {file.stat().st_size} bytes, where {manifest.name} lists a {what} of "
                                 f"{size}: the dataset is not whole; {again(folder, name)}")


def unfinished(folder: Path) -> list[Path]:
    """The folders of preparations into `folder` that did not finish (killed, or running now)."""
    return sorted(p for p in folder.glob(PARTIAL.format(name="*")) if p.is_dir()) if folder.is_dir() else []
