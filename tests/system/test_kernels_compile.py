"""Every kernel source (kernels/ and the dev/cuda ladders) compiles with nvcc for Hopper (sm_90a) and
Ampere (sm_80), and the runtime finds the sources. Runs in CI without a GPU; skipped where nvcc is missing."""

import re
import shutil
import subprocess

import pytest

from llama.runtime.cuda import gpu_target, kernel_dir
from tests.runs import REPO

pytestmark = pytest.mark.slow  # nvcc on every source: minutes on a 2-core machine
SOURCES = sorted(kernel_dir().glob("*.cu"))
DEV_SOURCES = sorted((REPO / "dev" / "cuda").glob("*.cu"))  # the ladders


def test_all_layer_families_present():
    names = {p.stem for p in SOURCES}
    assert {"embedding", "rmsnorm", "matmul", "rope", "attention", "swiglu", "residual", "classifier",
            "adamw", "global_norm"} <= names


def test_gpu_target():
    assert gpu_target((9, 0)) == ("compute_90a", "sm_90a")
    assert gpu_target((8, 0)) == ("compute_80", "sm_80")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", ["90a", "80"])
@pytest.mark.parametrize("source", SOURCES + DEV_SOURCES, ids=lambda p: p.name)
def test_compiles(source, arch, tmp_path):
    result = subprocess.run(["nvcc", "-cubin", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}",
                             "-I", str(kernel_dir()), "-o", str(tmp_path / "k.cubin"), str(source)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr.lower(), result.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_the_gemv_arguments_match_their_numpy_layout(tmp_path):
    """The GEMV launcher packs kernels/gemv.cu's GemvArgs struct by hand (llama/ops/gemv.py's GEMV_ARGS):
    every field's offset and the size must be the C compiler's."""
    from llama.ops.gemv import GEMV_ARGS
    fields = "".join(f'    printf("{name} %zu\\n", offsetof(GemvArgs, {name}));\n' for name in GEMV_ARGS.names)
    program = tmp_path / "layout.cu"
    program.write_text(f'#include <cstdio>\n#include <cstddef>\n#include "gemv.cu"\nint main() {{\n{fields}'
                       '    printf("sizeof %zu\\n", sizeof(GemvArgs));\n}\n')
    build = subprocess.run(["nvcc", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-I", str(kernel_dir()), "-o", str(tmp_path / "layout"),
                            str(program)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    printed = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True).stdout.split()
    layout = dict(zip(printed[::2], map(int, printed[1::2])))
    assert layout == {name: GEMV_ARGS.fields[name][1] for name in GEMV_ARGS.names} | {"sizeof": GEMV_ARGS.itemsize}


def constants_read() -> dict[str, set[str]]:
    """Every constant a launcher (llama/ops, dev/cuda) reads with kernel_constant, by module: kernels/<module>.cu's
    (kernel_constant("module", "NAME")), and as "dev/cuda/<module>" the ladders' sources' (kernel_constant("module",
    "NAME", LADDER))."""
    read = {}
    for source in [*(REPO / "llama" / "ops").glob("*.py"), *(REPO / "dev" / "cuda").glob("*.py")]:
        for module, name, ladder in re.findall(r'kernel_constant\("(\w+)", "(\w+)"(, LADDER)?\)', source.read_text()):
            read.setdefault("dev/cuda/" * bool(ladder) + module, set()).add(name)
    return read


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("module", sorted(constants_read()))
def test_the_launchers_read_the_kernels_own_constants(module, tmp_path):
    """The launchers' tile and block sizes come from the kernel sources (llama/ops/common.py's kernel_constant
    parses them): each value is the one the C compiler gives that constant in the Hopper build's device code
    (where every constant of the wgmma kernels is defined), checked by static_assert."""
    from llama.ops.common import kernel_constant
    folder, name_of = (REPO / "dev" / "cuda", module.rsplit("/", 1)[1]) if "/" in module else (kernel_dir(), module)
    namespaces = set(re.findall(r"^namespace (\w+) \{", (folder / f"{name_of}.cu").read_text(), re.M))
    uses = "".join(f"using namespace {namespace};\n" for namespace in sorted(namespaces))
    asserts = "".join(f'static_assert(({name}) == {kernel_constant(name_of, name, folder)}, "{name}");\n'
                      for name in sorted(constants_read()[module]))
    program = tmp_path / "constants.cu"
    program.write_text(f'#include "{name_of}.cu"\n{uses}#ifdef __CUDA_ARCH__\n{asserts}#endif\n')
    build = subprocess.run(["nvcc", "-ptx", "-std=c++17", "-arch=sm_90a", "-I", str(kernel_dir()), "-I", str(folder),
                            "-o", str(tmp_path / "constants.ptx"), str(program)], capture_output=True, text=True,
                           timeout=300)
    assert build.returncode == 0, build.stderr
