"""The kernel cache (llama/runtime/kernel_build.py) without a GPU: keys, corrupt entries, build errors, units of one
entry point, and parallel builds with nvcc."""

import re
import runpy
import shutil
import subprocess
import threading
import time
from io import StringIO
from pathlib import Path

import pytest

from llama.runtime import kernel_build
from llama.runtime.kernel_build import (KernelBuildError, Unit, build, cached, cubin_of, kernel_dir, store, units_of,
                                        unit_of)

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
GUARDED = """#include "scale.cuh"
#if KERNEL_ENTRY(first)
extern "C" __global__ void first(float* x) { x[0] = SCALE; }
#endif
#if KERNEL_ENTRY(second)
extern "C" __global__ void second(float* x) { x[1] = SCALE; }
#endif
"""


@pytest.fixture
def sources(tmp_path, monkeypatch):
    """A two-entry kernel file including a header, under tmp_path/src; the cache in tmp_path/cache."""
    monkeypatch.setenv(kernel_build.CACHE_ENV, str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "scale.cuh").write_text("#define SCALE 2.0f\n")
    (src / "two.cu").write_text("#ifndef KERNEL_ENTRY\n#define KERNEL_ENTRY(name) 1\n#endif\n" + GUARDED)
    return src


def entry_points(cubin: bytes) -> set[str]:
    return set(re.findall(rb"\.text\.(\w+)", cubin))


def test_cache_dir_moves_with_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(kernel_build.CACHE_ENV, raising=False)
    monkeypatch.delenv("LLAMA_CUDA_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernel_build.cache_dir() == tmp_path / "llama-cuda" / "kernels"
    monkeypatch.setenv("LLAMA_CUDA_CACHE", str(tmp_path / "cache"))  # the per-user cache, moved
    assert kernel_build.cache_dir() == tmp_path / "cache" / "kernels"
    monkeypatch.setenv(kernel_build.CACHE_ENV, str(tmp_path / "elsewhere"))
    assert kernel_build.cache_dir() == tmp_path / "elsewhere"


def test_key_follows_sources_headers_and_options(sources):
    unit = Unit(sources / "two.cu", "sm_90a")
    key = unit.key()
    assert Unit(sources / "two.cu", "sm_90a").key() == key
    assert Unit(sources / "two.cu", "sm_80").key() != key
    assert Unit(sources / "two.cu", "sm_90a", "first").key() != key
    shutil.copytree(sources, sources.parent / "moved")  # another checkout of the same sources shares the cache
    assert Unit(sources.parent / "moved" / "two.cu", "sm_90a").key() == key
    (sources / "unrelated.cuh").write_text("#define OTHER 1\n")
    assert unit.key() == key
    (sources / "scale.cuh").write_text("#define SCALE 3.0f\n")
    assert unit.key() != key


def test_headers_found_recursively_beside_the_includer_and_in_kernels(sources):
    assert kernel_build.sources_of(sources / "two.cu") == [sources / "two.cu", sources / "scale.cuh"]
    found = {path.name for path in kernel_build.sources_of(kernel_dir() / "gemm_wgmma.cu")}
    assert {"gemm_wgmma.cu", "wgmma.cuh", "gemm_epilogue.cuh", "common.cuh"} <= found


def test_units_one_per_guarded_entry_point(sources):
    assert [u.entry for u in units_of(sources / "two.cu", "sm_90a")] == ["first", "second"]
    assert unit_of(sources / "two.cu", "sm_90a", "second").entry == "second"
    assert unit_of(sources / "two.cu", "sm_90a").entry is None  # the whole file
    assert [u.entry for u in units_of(kernel_dir() / "convert.cu", "sm_90a")] == [None]
    assert unit_of(kernel_dir() / "convert.cu", "sm_90a", "round_to_bf16").entry is None
    assert len(units_of(kernel_dir() / "gemm_wgmma.cu", "sm_90a")) == 20
    assert len(units_of(kernel_dir() / "gemv.cu", "sm_90a")) == 8
    assert len(units_of(kernel_dir() / "gemm_mma.cu", "sm_90a")) == 7


def test_a_corrupt_or_partial_entry_is_not_loaded(sources):
    unit = Unit(sources / "two.cu", "sm_90a")
    store(kernel_build.entry_path(unit, unit.key()), b"\x7fELF pretend cubin")
    assert cached(unit) == b"\x7fELF pretend cubin"
    [entry] = kernel_build.cache_dir().glob("*.cubin")
    data = entry.read_bytes()
    entry.write_bytes(data[:5] + b"X" + data[6:])
    assert cached(unit) is None
    entry.write_bytes(data[:-1])
    assert cached(unit) is None
    entry.write_bytes(b"")
    assert cached(unit) is None
    assert not list(kernel_build.cache_dir().glob("*.partial"))


@pytest.mark.slow
def test_a_corrupt_entry_is_rebuilt(sources):
    unit = Unit(sources / "two.cu", "sm_90a")
    store(kernel_build.entry_path(unit, unit.key()), b"\x7fELF truncated")
    [entry] = kernel_build.cache_dir().glob("*.cubin")
    entry.write_bytes(entry.read_bytes()[:-3])
    assert entry_points(cubin_of(unit)) == {b"first", b"second"}
    assert entry_points(cached(unit)) == {b"first", b"second"}


@pytest.mark.slow
def test_a_unit_of_one_entry_point_compiles_it_alone(sources):
    units = units_of(sources / "two.cu", "sm_90a")
    report = StringIO()
    build(units, report)
    assert re.fullmatch(r"compiling 2 kernels for sm_90a on \d+ cores? \(cache .*\) \.\.\. \d+\.\d s\n",
                        report.getvalue())
    assert [entry_points(cached(u)) for u in units] == [{b"first"}, {b"second"}]
    report = StringIO()
    assert build(units, report) == 0.0 and report.getvalue() == ""  # all cached: nothing to say


@pytest.mark.slow
def test_a_build_error_names_the_file_and_shows_nvccs_messages(sources):
    (sources / "broken.cu").write_text('extern "C" __global__ void broken(float* x) { x[0] = undeclared; }\n')
    report = StringIO()
    with pytest.raises(KernelBuildError) as failure:
        build([Unit(sources / "broken.cu", "sm_90a"), Unit(sources / "two.cu", "sm_90a")], report)
    message = str(failure.value)
    assert message.startswith(f"nvcc could not compile {sources / 'broken.cu'} for sm_90a:\n")
    assert "identifier \"undeclared\" is undefined" in message and "Traceback" not in message
    assert report.getvalue().endswith(" failed\n")
    assert cached(Unit(sources / "two.cu", "sm_90a")) is not None  # the others were built all the same
    assert not list(kernel_build.cache_dir().glob("broken*"))


@pytest.mark.slow
def test_real_kernels_build_in_parallel_as_nvcc_builds_them(sources):
    units = [unit_of(kernel_dir() / "convert.cu", "sm_90a"), unit_of(kernel_dir() / "gemv.cu", "sm_90a",
                                                                      "gemv_residual_b8")]
    report = StringIO()
    build(units, report)
    assert report.getvalue().startswith("compiling 2 kernels for sm_90a")
    assert entry_points(cached(units[0])) == {b"round_to_bf16", b"widen_bf16"}
    assert entry_points(cached(units[1])) == {b"gemv_residual_b8"}
    plain = subprocess.run(["nvcc", "--cubin", *units[0].options(), "-o", "/dev/stdout", str(units[0].source)],
                           capture_output=True, check=True).stdout
    assert plain == cached(units[0])


def test_the_build_script_builds_what_training_can_launch_or_everything(sources, monkeypatch, capsys):
    built = []
    monkeypatch.setattr(kernel_build, "compile_unit", built.append)  # nothing compiled, so nothing cached
    main = runpy.run_path(str(Path(kernel_build.__file__).parents[2] / "scripts" / "build_kernels.py"))["main"]
    assert main(["--arch", "sm_90a"]) == 0
    names = {unit.name for unit in built}
    assert {"flash_attention_wgmma:flash_attention_forward_d64", "flash_attention_wgmma:flash_attention_backward_delta",
            "matmul", "fp8", "decode", "gemm_wgmma:gemm_wgmma5_nt", "gemm_wgmma:gemm_wgmma7_tn_128x256", "gemm_wgmma:gemm_wgmma6_fp8_128x128", "gemv:gemv_residual_b8"} <= names
    assert not names & {"flash_attention", "gemv:gemv_residual_b16"}
    assert capsys.readouterr().err.startswith(f"compiling {len(built)} kernels for sm_90a")
    built.clear()
    assert main(["--arch", "sm_90a", "--all"]) == 0
    assert len(built) == sum(len(units_of(source, "sm_90a")) for source in kernel_dir().glob("*.cu"))

    def failing(unit):
        raise KernelBuildError(f"nvcc could not compile {unit.source}")

    monkeypatch.setattr(kernel_build, "compile_unit", failing)
    assert main(["--arch", "sm_90a"]) == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith("error: nvcc could not compile ")


def test_processes_building_at_once_compile_each_unit_once(sources, monkeypatch):
    """Ranks of one run build the same units: the first builds, the others wait and find them cached."""
    compiled = []

    def slow_compile(unit):
        compiled.append(unit)
        time.sleep(0.2)
        store(kernel_build.entry_path(unit, unit.key()), b"\x7fELF " + unit.name.encode())

    monkeypatch.setattr(kernel_build, "compile_unit", slow_compile)
    units = units_of(sources / "two.cu", "sm_90a")
    ranks = [threading.Thread(target=build, args=(units, StringIO())) for _ in range(3)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join()
    assert sorted(unit.entry for unit in compiled) == ["first", "second"]
