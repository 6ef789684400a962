"""The kernel sources travel as package data: a built wheel carries them, and the runtime finds
them in an installed copy (not only in a source checkout); every package of llama/ is in the wheel."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.runs import REPO

pytestmark = pytest.mark.slow  # builds a wheel


def test_wheel_carries_every_package_and_the_kernels(tmp_path):
    # setuptools comes with the test extra: no build isolation, so no network is needed
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    wheel = next(tmp_path.glob("llama_cuda-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    kernels = {Path(n).name for n in names if n.startswith("llama/kernels/")}
    assert kernels == {p.name for p in (REPO / "kernels").iterdir() if p.suffix in (".cu", ".cuh")}
    modules = {str(p.relative_to(REPO)) for p in (REPO / "llama").rglob("*.py")}
    assert modules <= set(names), f"not in the wheel: {sorted(modules - set(names))}"
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # a pure-Python wheel installs by unpacking
    found = subprocess.run([sys.executable, "-c", "import llama.runtime.cuda; print(llama.runtime.cuda.kernel_dir())"],
                           capture_output=True, text=True, cwd=tmp_path, env={"PYTHONPATH": str(site)}, timeout=60)
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()) == site / "llama" / "kernels"
