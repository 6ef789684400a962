"""Where a task's file comes from: the original public file, downloaded on first use into eval/ of the per-user
cache (resumed and retried by llama/data/download.py, checked against its git blob id where one is pinned), a
mirror serving the same paths, or a local copy: a file, or a folder searched for the names a copy may have."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from ..cache import cache_dir
from ..data.download import DownloadError, download
from .items import TaskError


@dataclass(frozen=True)
class Source:
    """An original public file: its URL, its place in the cache (under eval_data_dir()) and, where it could be
    verified, the git blob id of its bytes in the repository that serves it."""
    url: str
    dest: str
    git_blob: str | None = None


def eval_data_dir() -> Path:
    """Where downloaded task files are kept: beside the starter pack, in the per-user cache (llama/cache.py)."""
    return cache_dir() / "eval"


def git_blob_id(path: Path) -> str:
    """The id git gives a file's contents: SHA-1 of "blob <size>\\0" and the bytes."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_url(text: str | None) -> bool:
    return text is not None and text.startswith(("http://", "https://"))


def downloaded(source: Source, data_dir: str | Path | None = None, mirror: str | None = None,
               hint: str = "") -> Path:
    """The source's file in the cache (data_dir, default eval_data_dir()), downloaded there when missing or not
    the pinned one, from its URL or from `mirror` (a base URL serving the same path). hint ends the error of a
    download that fails (what else the user may do)."""
    dest = Path(data_dir if data_dir is not None else eval_data_dir()) / source.dest
    if dest.is_file() and (source.git_blob is None or git_blob_id(dest) == source.git_blob):
        return dest
    if dest.exists():
        dest.unlink()  # download() would take any complete file under the final name as verified
    url = source.url if mirror is None else mirror.rstrip("/") + urlparse(source.url).path
    try:
        download(url, dest)
    except DownloadError as e:
        raise TaskError(f"{e}{hint}") from None
    if source.git_blob is not None and git_blob_id(dest) != source.git_blob:
        dest.unlink()
        raise TaskError(f"{url}: the downloaded file is not the expected one (its git blob id is not "
                        f"{source.git_blob}); it was deleted")
    return dest


def in_cache(path: Path, data_dir: str | Path | None = None) -> bool:
    """Whether the path is a download of ours (in data_dir, default eval_data_dir())."""
    root = Path(data_dir if data_dir is not None else eval_data_dir()).resolve()
    return root in path.resolve().parents


def find_copy(folder: Path, names: tuple[str, ...]) -> Path | None:
    """The first of `names` (file names, or paths ending in them such as "COPA/val.jsonl") found in the folder
    or below it, in the order of names; None when none is there."""
    for name in names:
        found = sorted(folder.glob(f"**/{name}"))
        if found:
            return found[0]
    return None
