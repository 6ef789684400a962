"""The Llama 3 tokenizer without a Hugging Face token, from Meta's llama-models wheel.

Meta publishes its `llama-models` package on the Python package index; the 0.3.0 wheel ships
`llama_models/llama3/tokenizer.model`, the same file as the gated Hugging Face one. pip downloads
that one wheel (no dependencies, nothing installed) into a temporary folder, using the index and
proxies pip is configured with (or --index-url); the file is taken out of the wheel, checked
(size and sha256) and written atomically to its destination. A wheel file on disk works the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .download import is_verified, sha256_of

REQUIREMENT = "llama-models==0.3.0"
WHEEL_MEMBER = "llama_models/llama3/tokenizer.model"
LLAMA3_TOKENIZER = dict(size=2_183_982, sha256="82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55")
# The package index to ask; None: pip's own configuration. LLAMA_PACKAGE_INDEX overrides it (the
# tests point it at a closed local port, for the trainers they start in subprocesses too).
INDEX_URL: str | None = os.environ.get("LLAMA_PACKAGE_INDEX")


class FetchError(RuntimeError):
    """The tokenizer could not be fetched; the message says why in one line."""


def extract_tokenizer(wheel: str | Path, dest: str | Path) -> Path:
    """Take tokenizer.model out of a llama-models wheel, verify it, write it to dest."""
    wheel, dest = Path(wheel), Path(dest)
    expected = LLAMA3_TOKENIZER
    try:
        with zipfile.ZipFile(wheel) as archive:
            data = archive.read(WHEEL_MEMBER)
    except FileNotFoundError:
        raise FetchError(f"wheel not found: {wheel}") from None
    except KeyError:
        raise FetchError(f"{wheel} holds no {WHEEL_MEMBER}") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise FetchError(f"cannot read wheel {wheel}: {e}") from None
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    part.write_bytes(data)
    if len(data) != expected["size"] or sha256_of(part) != expected["sha256"]:
        part.unlink()
        raise FetchError(f"{WHEEL_MEMBER} in {wheel} does not match the Llama 3 tokenizer "
                         f"({len(data)} bytes; expected {expected['size']} bytes, sha256 {expected['sha256'][:12]}...)")
    os.replace(part, dest)
    return dest


def download_wheel(folder: Path, index_url: str | None = None, timeout: float = 15.0, retries: int = 2) -> Path:
    """`pip download --no-deps` of the llama-models wheel into folder; returns the wheel's path.
    With index_url, pip uses that index only and ignores its configuration files."""
    command = [sys.executable, "-m", "pip"]
    index_url = index_url or INDEX_URL
    if index_url:
        command += ["--isolated"]
    command += ["download", "--no-deps", "--only-binary", ":all:", "--ignore-requires-python",
                "--disable-pip-version-check", "--dest", str(folder), "--timeout", str(timeout),
                "--retries", str(retries), REQUIREMENT]
    if index_url:
        command += ["--index-url", index_url]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout * (retries + 2) + 60)
    except subprocess.TimeoutExpired:
        raise FetchError(f"pip download {REQUIREMENT} did not finish") from None
    wheels = sorted(folder.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        lines = [line.strip() for line in (result.stderr + result.stdout).splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else "")
        raise FetchError(f"pip could not download {REQUIREMENT} ({reason or f'exit code {result.returncode}'}); "
                         "is the package index reachable?")
    return wheels[0]


def fetch_llama3_tokenizer(dest: str | Path, wheel: str | Path | None = None, index_url: str | None = None,
                           timeout: float = 15.0, retries: int = 2) -> Path:
    """dest, holding Meta's tokenizer.model: already there and verified, else taken from `wheel`
    (a llama-models wheel on disk) or from the wheel that pip downloads."""
    dest = Path(dest)
    if is_verified(dest, LLAMA3_TOKENIZER["size"], LLAMA3_TOKENIZER["sha256"]):
        return dest
    if wheel is not None:
        return extract_tokenizer(wheel, dest)
    with tempfile.TemporaryDirectory(prefix="llama-models-") as folder:
        return extract_tokenizer(download_wheel(Path(folder), index_url, timeout, retries), dest)
