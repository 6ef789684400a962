"""Robust file download: resume with HTTP Range, retries with backoff, size and sha256 checks.

The bytes go to `<dest>.part`; only a complete and verified file is renamed to `dest`, so a file
under its final name is always a verified one: an existing `dest` that fails verification is
removed first. A `.part` left by an interrupted run is resumed next time (and discarded when it is
larger than the file, or when the file it completes fails verification). Dropped connections,
timeouts and 5xx answers are retried; a refused connection or a failed DNS lookup (offline) is not.
"""

from __future__ import annotations

import errno
import hashlib
import os
import sys
import time
from pathlib import Path

import requests
import urllib3

from ..runtime.progress import bar

GATED_HELP = ("The Llama 3 tokenizer is in a gated repository on the Hugging Face hub. To get it: "
              "1) sign in at huggingface.co and accept the license on the meta-llama/Llama-3.1-8B page; "
              "2) create an access token (Settings -> Access Tokens, 'read'); "
              "3) pass it with --hf-token or the HF_TOKEN environment variable.")


class DownloadError(RuntimeError):
    """A download that cannot complete; the message says why and what to do."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_verified(path: Path, size: int | None = None, sha256: str | None = None) -> bool:
    if not path.is_file():
        return False
    if size is not None and path.stat().st_size != size:
        return False
    return sha256 is None or sha256_of(path) == sha256


def download(url: str, dest: str | Path, *, size: int | None = None, sha256: str | None = None,
             headers: dict | None = None, retries: int = 5, backoff: float = 1.0, timeout: float = 30.0,
             gated: bool = False, progress: bool = True) -> Path:
    """Download url to dest unless dest is already there and verified. Returns dest.

    Dropped connections, timeouts and 5xx answers are retried `retries` times, waiting
    backoff * 2^attempt seconds. A refused connection or a failed DNS lookup is final at once, as is
    a 401/403 (with the gated-repository help when `gated`) or a 404.
    """
    dest = Path(dest)
    if is_verified(dest, size, sha256):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        print(f"note: removing {dest}: it does not match the expected size and checksum", file=sys.stderr)
        dest.unlink()
    part = dest.with_name(dest.name + ".part")
    if size is not None and part.exists() and part.stat().st_size > size:
        part.unlink()  # larger than the file: left by something else
    resumed = part.exists() and part.stat().st_size > 0
    fetch = (url, part, size, headers or {}, retries, backoff, timeout, gated, progress, dest.name)
    _fetch_with_retries(*fetch)
    if resumed and not is_verified(part, size, sha256):
        part.unlink()  # the .part we resumed was of another version of the file: start over once
        _fetch_with_retries(*fetch)
    if not is_verified(part, size, sha256):
        got = f"{part.stat().st_size} bytes, sha256 {sha256_of(part)}"
        part.unlink()
        raise DownloadError(f"{url}: downloaded file does not match (expected {size} bytes, sha256 {sha256}; "
                            f"got {got}); it was deleted")
    os.replace(part, dest)
    return dest


def _cannot_connect(e: requests.exceptions.ConnectionError) -> str | None:
    """Why no connection could be made (refused, unreachable, no DNS), or None for other failures."""
    reason = getattr(e.args[0], "reason", None) if e.args else None
    if isinstance(reason, urllib3.exceptions.NewConnectionError):
        return str(reason).split(": ", 1)[-1]  # after the connection object's repr
    return None


def _fetch_with_retries(url: str, part: Path, size: int | None, headers: dict, retries: int, backoff: float,
                        timeout: float, gated: bool, progress: bool, label: str) -> None:
    attempt = 0
    while True:
        try:
            if _fetch_into(url, part, size, headers, timeout, progress, label):
                return
            failure = "the server closed the connection early"
        except requests.exceptions.HTTPError as e:
            status = e.response.status_code
            if status in (401, 403):
                raise DownloadError(f"{url}: access refused ({status}). " + (GATED_HELP if gated else "")) from None
            if status == 404:
                raise DownloadError(f"{url}: not found (404); check the URL or --base-url") from None
            if status < 500:
                raise DownloadError(f"{url}: HTTP {status}") from None
            failure = f"HTTP {status}"
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout,
                requests.exceptions.ChunkedEncodingError) as e:
            reason = _cannot_connect(e) if isinstance(e, requests.exceptions.ConnectionError) else None
            if reason:
                raise DownloadError(f"{url}: {reason}. Offline? Check the network connection, then rerun") from None
            failure = f"{type(e).__name__}: {e}"
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise DownloadError(f"disk full while writing {part}; free space and rerun to resume") from None
            raise DownloadError(f"cannot write {part}: {e.strerror}") from None
        if attempt >= retries:
            raise DownloadError(f"{url}: giving up after {retries + 1} tries ({failure}); "
                                "check the network connection, then rerun to resume") from None
        time.sleep(backoff * 2 ** attempt)
        attempt += 1


def _fetch_into(url: str, part: Path, size: int | None, headers: dict, timeout: float,
                progress: bool, label: str) -> bool:
    """One request, appending to part from where it ends. True when the file is complete."""
    have = part.stat().st_size if part.exists() else 0
    if size is not None and have == size:
        return True
    request_headers = dict(headers)
    if have:
        request_headers["Range"] = f"bytes={have}-"
    with requests.get(url, headers=request_headers, stream=True, timeout=timeout) as r:
        if r.status_code == 416 and have:  # nothing past what we have
            return True
        r.raise_for_status()
        if have and r.status_code != 206:
            have = 0  # the server ignored Range: start over
        total = int(r.headers["Content-Length"]) + have if "Content-Length" in r.headers else size
        with open(part, "ab" if have else "wb") as f, \
                bar(total=total, initial=have, unit="B", unit_scale=True, desc=label, show=progress) as shown:
            for chunk in r.iter_content(chunk_size=1 << 16):
                f.write(chunk)
                shown.update(len(chunk))
            f.flush()
            os.fsync(f.fileno())
    got = part.stat().st_size
    return total is None or got >= total
