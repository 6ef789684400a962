"""The ladders' host side, without a GPU (the arrays are descriptors of no memory): the rungs' numbering and what
each carries, their launchers' checks, their sources' entry points and launch tables."""

import inspect

import numpy as np
import pytest

from dev.cuda import gemm_ladder
from dev.cuda.flash_attention_ladder import LADDER, VERSIONS, Build
from llama.runtime.kernel_build import entries_of, kernel_dir
from tests.unit.test_document_mask_launchers import bounds
from tests.unit.test_flash_attention_launcher import (B, H, T, backward_args, fake, forward_args, launch_table,
                                                      top_level_values)


def test_flash_rungs_and_what_each_carries():
    rungs = [Build.rung(v) for v in VERSIONS]
    assert [r.source.module for r in rungs] == [f"flash_attention_v{v}" for v in VERSIONS]
    assert all(r.source.directory == LADDER and (LADDER / f"{r.source.module}.cu").exists() for r in rungs)
    assert [r.source.tma for r in rungs] == [False, False, True, True, True, True]  # wgmma from v3
    assert [r.source.document_mask for r in rungs] == [False] + [True] * 5  # the mask from v2
    assert [r.fused_dq for r in rungs] == [False] * 3 + [True, False, False]  # v5, v6 run v3's backward
    assert [r.nondeterministic_backward for r in rungs] == [True, False, False, True, False, False]
    with pytest.raises(ValueError, match="no v7"):
        Build.rung(7)


def launch(method, arguments: dict) -> None:
    """A Build's forward or backward with the production launchers' test arguments (tests/unit), less the source."""
    method(**{name: value for name, value in arguments.items() if name != "source"})


def test_v1_refuses_the_document_mask():
    with pytest.raises(ValueError, match="flash_attention_v1 has no document mask"):
        launch(Build.rung(1).forward, forward_args(**bounds()))


def test_v4s_backward_takes_its_larger_scratch():
    """v4's scratch holds delta, then the fp32 dQ tiles and their counts: the production size is refused."""
    assert Build.rung(4).scratch_size(B, T, H, 64) > Build.rung(3).scratch_size(B, T, H, 64) == B * H * T
    with pytest.raises(ValueError, match=rf"scratch: expected float32 \({Build.rung(4).scratch_size(B, T, H, 64)},\)"):
        launch(Build.rung(4).backward, backward_args(scratch=fake((B * H * T,), np.float32)))


@pytest.mark.parametrize("version", [v for v in VERSIONS if v != 4])
def test_only_v4_has_an_unordered_backward(version):
    with pytest.raises(ValueError, match="no unordered backward"):
        launch(Build.rung(version).backward, backward_args(deterministic=False))


@pytest.mark.parametrize("path, table, columns", [("flash_attention_v1.cu", "flash_attention_config", 10),
                                                  ("flash_attention_v4.cu", "flash_attention_fused_config", 3)])
def test_the_rungs_own_launch_tables_fill_their_columns(path, table, columns):
    """v1 keeps its own table (as the production builds'); v4 adds the fused kernel's (threads, kv rows, shared)."""
    width, rows = launch_table(LADDER / path, table)
    assert width == columns and len(rows) == 2 and all(top_level_values(row) == columns for row in rows)


GEMM_RUNG_SOURCES = {"wgmma": "gemm_v2", "wgmma3": "gemm_v3", "wgmma4": "gemm_v4"}


@pytest.mark.parametrize("name, source", [*GEMM_RUNG_SOURCES.items(), ("wgmma5 fp8", "gemm_fp8_v5")])
def test_each_gemm_rung_is_its_own_sources_entry_points(name, source):
    """A rung's launcher loads its module, whose guarded entry points are the rung's (gemm_<version>_..., each a
    build unit of its own) and none of production's: kernels/gemm_wgmma.cu keeps only the versions the plan picks."""
    version = name.split()[0]
    launcher = (gemm_ladder.FP8_RUNGS if name.endswith("fp8") else gemm_ladder.RUNGS)[version].launch
    assert f'"{source}"' in inspect.getsource(launcher)
    entries = entries_of(LADDER / f"{source}.cu")
    assert entries and all(e.startswith(f"gemm_{version}_") for e in entries)
    assert not set(entries) & set(entries_of(kernel_dir() / "gemm_wgmma.cu"))


def test_the_ladders_version_tables():
    """Every bf16 rung by name, in ladder order, production's launchers among them; FP8's rung beside production's."""
    from llama.ops.fp8 import FP8_GEMM_VERSIONS
    from llama.ops.gemm import GEMM_VERSIONS
    assert list(gemm_ladder.VERSIONS) == ["mma", "wgmma", "wgmma3", "wgmma4", "wgmma5", "wgmma6", "wgmma7", "wgmma8"]
    assert gemm_ladder.VERSIONS.items() >= GEMM_VERSIONS.items() and gemm_ladder.FP8_VERSIONS.items() >= \
        FP8_GEMM_VERSIONS.items()
    assert not set(gemm_ladder.RUNGS) & set(GEMM_VERSIONS) and not set(gemm_ladder.FP8_RUNGS) & set(FP8_GEMM_VERSIONS)
    in_kernel = [name for name, v in gemm_ladder.VERSIONS.items() if v.splits_in_kernel]
    assert in_kernel == ["wgmma3", "wgmma5", "wgmma8"]  # the ping-pong versions
    assert gemm_ladder.LADDER == LADDER
