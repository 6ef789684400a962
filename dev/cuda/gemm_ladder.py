"""The GEMM ladder's rungs that the plan does not pick, with their launchers: versions 2 (`wgmma`, dev/cuda/gemm_v2.cu),
3 (`wgmma3`, gemm_v3.cu) and 4 (`wgmma4`, gemm_v4.cu) in bf16, and FP8's version 5 (gemm_fp8_v5.cu), each an
include of kernels/gemm_wgmma.cu plus the rung's own entry points. VERSIONS and FP8_VERSIONS are every rung by
name, production's (llama/ops/gemm.py's GEMM_VERSIONS, llama/ops/fp8.py's FP8_GEMM_VERSIONS) and these, for
`ops.gemm(..., version=name, versions=VERSIONS)` and `ops.gemm_fp8(..., versions=FP8_VERSIONS)`: the runner
dev/cuda/gemm.py, the tests dev/cuda/test_gemm_ladder.py and scripts/bench_matmul.py take them from here."""

from __future__ import annotations

import math
from pathlib import Path

from llama.ops.common import kernel, kernel_constant, multiprocessors
from llama.ops.fp8 import FP8_GEMM_VERSIONS
from llama.ops.gemm import GEMM_VERSIONS, GemmVersion
from llama.ops.gemm_problem import GemmProblem
from llama.ops.gemm_wgmma import (BK, PINGPONG_STAGED_STAGES, STAGING_BYTES, cooperative_stages, device_maps,
                                  launch_cooperative, launch_pingpong, operand_maps)

LADDER = Path(__file__).resolve().parent  # the rungs' sources
V2_STAGES = cooperative_stages("gemm_v2", LADDER)  # pipeline stages by tile width
V3_STAGES = kernel_constant("gemm_v3", "PP_STAGES", LADDER)  # 128 x 128 tiles
CLUSTER_BM = kernel_constant("gemm_v4", "CL_BM", LADDER)  # 256 x 128 tiles per CTA
CLUSTER_STAGES = kernel_constant("gemm_v4", "CL_STAGES", LADDER)


def gemm_wgmma(p: GemmProblem, bn: int | None = None) -> None:
    """Version 2: wgmma + TMA, warp-specialized, persistent (one CTA per multiprocessor at most), cooperative
    consumers on 128 x BN tiles, the epilogue stored from the registers."""
    launch_cooperative(p, bn, "gemm_wgmma", staging=0, stages=V2_STAGES, module="gemm_v2", directory=LADDER)


def gemm_wgmma3(p: GemmProblem, splits: int = 1) -> None:
    """Version 3: ping-pong consumer warpgroups on 128 x 128 tiles, persistent, the epilogue stored from the
    registers; splits as version 5's (llama/ops/gemm_wgmma.py)."""
    launch_pingpong(p, splits, "gemm_wgmma3", V3_STAGES, staging=0, module="gemm_v3", directory=LADDER)


def gemm_wgmma4(p: GemmProblem) -> None:
    """Version 4: clusters of two CTAs, each a 256 x 128 tile of C with cooperative consumers; the pair
    shares its 256 rows of A, each CTA loading half and multicasting it to both. Persistent (one pair of
    multiprocessors per cluster at most)."""
    pairs = math.ceil(p.M / CLUSTER_BM) * math.ceil(p.N / 256) * p.batch
    maps = device_maps(b"".join(operand_maps(p, 128)))
    shared = CLUSTER_STAGES * (CLUSTER_BM + 128) * BK * 2 + 1024 + 16 * CLUSTER_STAGES
    kernel("gemm_v4", f"gemm_wgmma4_{p.layout}", "PPPPqiiiiiiiiif", LADDER)(
        (2 * min(pairs, multiprocessors() // 2),), 384, maps.ptr, p.c, p.cos, p.sin, p.stride_c, p.M, p.N, p.K,
        p.batch, *p.epilogue_args(), shared=shared)


def gemm_wgmma5_fp8(p: GemmProblem, splits: int = 1) -> None:
    """FP8's version 5: version 5's ping-pong kernel on e4m3 operands (gemm_wgmma5_fp8); splits as version 5's."""
    launch_pingpong(p, splits, "gemm_wgmma5", PINGPONG_STAGED_STAGES, staging=STAGING_BYTES, module="gemm_fp8_v5",
                    directory=LADDER)


RUNGS = {"wgmma": GemmVersion(gemm_wgmma), "wgmma3": GemmVersion(gemm_wgmma3, splits_in_kernel=True),
         "wgmma4": GemmVersion(gemm_wgmma4)}  # the bf16 rungs kept here
ORDER = ("mma", "wgmma", "wgmma3", "wgmma4", "wgmma5", "wgmma6", "wgmma7", "wgmma8")  # the bf16 ladder, by version
VERSIONS = {name: (GEMM_VERSIONS | RUNGS)[name] for name in ORDER}
FP8_RUNGS = {"wgmma5": GemmVersion(gemm_wgmma5_fp8, splits_in_kernel=True)}  # FP8's rung kept here
FP8_VERSIONS = FP8_RUNGS | FP8_GEMM_VERSIONS
