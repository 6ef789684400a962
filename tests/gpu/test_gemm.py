"""The bf16 tensor-core GEMM against the float64 product of the same bf16-rounded inputs, every
layout, batched and not, at tile multiples and odd shapes, every epilogue, each GEMM version the
device runs that the plan picks from (GEMM_VERSIONS). Fresh random inputs each run; outputs NaN-poisoned first.
The ladder's other rungs run these same tests from dev/cuda/test_gemm_ladder.py, through the fixtures `gemm`,
`version` and `splitting_version`.

Tolerances (‖out − ref‖ / ‖ref‖): fp32 output 1e-5, bf16 output 5e-3."""

import importlib

import numpy as np
import pytest

from llama.ops.gemm import GEMM_VERSIONS
from llama.run.plan import DYNAMIC_TWINS
from llama.twins.matmul import matmul_forward
from llama.twins.rope import rotate_pairs
from tests.gpu_helpers import bf16_round, check, dev, dev_bf16, poisoned

pytestmark = pytest.mark.gpu
rng = np.random.default_rng()
TOL = {"f32": 1e-5, "bf16": 5e-3}


@pytest.fixture(scope="module")
def ops():
    from llama import ops
    return ops


def runs_on_this_gpu(version: str) -> str:
    """version, which the test takes; skipped where it cannot run (every version but 'mma' needs sm_90a)."""
    from llama.runtime.cuda import runtime
    if version != "mma" and runtime().device.compute_capability() != (9, 0):
        pytest.skip(f"{version} needs sm_90a")
    return version


@pytest.fixture(params=list(GEMM_VERSIONS))
def version(request):
    return runs_on_this_gpu(request.param)


@pytest.fixture(params=[name for name, v in GEMM_VERSIONS.items() if v.splits_in_kernel])
def splitting_version(request):
    """The versions that split K inside the kernel."""
    return runs_on_this_gpu(request.param)


@pytest.fixture
def gemm(ops):
    """The GEMM front the tests run their versions through."""
    return ops.gemm


def operands(layout, M, N, K, batch):
    """Random bf16 operands stored as the layout says, and op(a), op(b) in float64."""
    lead = (batch,) if batch > 1 else ()
    a = bf16_round(rng.standard_normal(lead + ((K, M) if layout == "tn" else (M, K))))
    b = bf16_round(rng.standard_normal(lead + ((N, K) if layout == "nt" else (K, N))))
    return a, b, (a.swapaxes(-1, -2) if layout == "tn" else a), (b.swapaxes(-1, -2) if layout == "nt" else b)


SHAPES = {  # (M, N, K, batch) per layout: M and N of an M- or N-major operand are multiples of 8
    # (2000, 2056, 776): 272 tiles of 128 x 128, two or more per persistent CTA, a partial last k-block;
    # (4000, 1032, 136): 80 cluster units of 256 x 256 (the ladder's version 4), more than the 66 clusters of an H100
    "nt": [(1, 8, 8, 1), (17, 136, 72, 1), (1000, 136, 768, 1), (16384, 8, 8192, 1), (17, 128256, 72, 1),
           (128, 256, 64, 1), (70, 48, 40, 3), (2000, 2056, 776, 1), (4000, 1032, 136, 1)],
    "nn": [(1, 8, 8, 1), (17, 136, 72, 1), (1000, 136, 768, 1), (16384, 136, 72, 1), (17, 128256, 72, 1),
           (128, 256, 64, 1), (70, 48, 40, 3)],
    "tn": [(8, 8, 8, 1), (1000, 136, 72, 1), (136, 1000, 768, 1), (1000, 8, 16384, 1), (16, 128256, 8, 1),
           (128, 256, 64, 1), (72, 48, 40, 3), (2056, 2000, 776, 1)],
}
CASES = [(layout, *shape) for layout, shapes in SHAPES.items() for shape in shapes]


@pytest.mark.parametrize("layout, M, N, K, batch", CASES)
@pytest.mark.parametrize("out", ["bf16", "f32"])
def test_gemm(gemm, version, layout, M, N, K, batch, out):
    from llama.runtime.cuda import BF16
    a, b, opa, opb = operands(layout, M, N, K, batch)
    c = poisoned(((batch,) if batch > 1 else ()) + (M, N), BF16 if out == "bf16" else np.float32)
    gemm(c, dev_bf16(a), dev_bf16(b), trans_a=layout == "tn", trans_b=layout == "nt", alpha=0.5, version=version)
    check(f"gemm_{version}_{out}[{layout}]", c, 0.5 * opa @ opb, TOL[out])


@pytest.mark.parametrize("layout, M, N, K, batch", [("nt", 17, 136, 72, 1), ("nn", 1000, 136, 768, 1),
                                                    ("tn", 1000, 136, 768, 1), ("tn", 72, 48, 40, 3)])
def test_gemm_accumulate(gemm, version, layout, M, N, K, batch):
    a, b, opa, opb = operands(layout, M, N, K, batch)
    c0 = rng.standard_normal(((batch,) if batch > 1 else ()) + (M, N)).astype(np.float32)
    c = dev(c0)
    gemm(c, dev_bf16(a), dev_bf16(b), trans_a=layout == "tn", trans_b=layout == "nt", alpha=-2.0,
         accumulate=True, version=version)
    check(f"gemm_{version}_accumulate[{layout}]", c, c0 - 2.0 * opa @ opb, TOL["f32"])
    gemm(c, dev_bf16(a), dev_bf16(b), trans_a=layout == "tn", trans_b=layout == "nt", alpha=0.0,
         accumulate=True, version=version)
    before = c.download()
    gemm(c, dev_bf16(a), dev_bf16(b), trans_a=layout == "tn", trans_b=layout == "nt", alpha=0.0,
         accumulate=True, version=version)
    assert np.array_equal(c.download().view(np.uint32), before.view(np.uint32)), "alpha = 0 changed c"


@pytest.mark.parametrize("B, T, H, KV, D", [(2, 37, 4, 2, 16), (1, 128, 12, 4, 64), (3, 5, 2, 1, 128)])
def test_gemm_rope_epilogue(gemm, version, B, T, H, KV, D):
    """The QKV projection with RoPE in its epilogue equals matmul_forward then RoPE on q and k."""
    from llama.runtime.cuda import BF16, to_device
    C = 64
    x = bf16_round(rng.standard_normal((B * T, C)))
    w = bf16_round(rng.standard_normal(((H + 2 * KV) * D, C)) / 8)
    angles = rng.uniform(0, 2 * np.pi, (T + 3, D // 2))
    cos, sin = np.cos(angles), np.sin(angles)
    out = poisoned((B * T, (H + 2 * KV) * D), BF16)
    gemm(out, dev_bf16(x), dev_bf16(w), trans_b=True, version=version,
         rope=(to_device(cos.astype(np.float32)), to_device(sin.astype(np.float32)), T, (H + KV) * D))
    heads = matmul_forward(x, w).reshape(B, T, H + 2 * KV, D).transpose(0, 2, 1, 3)
    rotated = rotate_pairs(heads[:, :H + KV], cos[:T], sin[:T])
    expected = np.concatenate([rotated, heads[:, H + KV:]], axis=1).transpose(0, 2, 1, 3).reshape(B * T, -1)
    check(f"gemm_{version}_rope", out, expected, TOL["bf16"])


@pytest.mark.parametrize("splits", [2, 3, 16])
def test_gemm_split_in_kernel(gemm, monkeypatch, splitting_version, splits):
    """Versions 5 and 8 (and the ladder's 3) split K inside the kernel over uneven K ranges (K = 1000: 16 k-blocks
    in splits of 8, 6 + 6 + 4 or 1, the last one partial), overwriting and accumulating."""
    version = splitting_version
    monkeypatch.setattr(importlib.import_module("llama.ops.gemm"), "splitk_splits3", lambda p, sms: splits)
    a, b, opa, opb = operands("tn", 200, 136, 1000, 1)
    c = poisoned((200, 136))
    gemm(c, dev_bf16(a), dev_bf16(b), trans_a=True, alpha=0.5, version=version)
    check(f"gemm_{version}_split{splits}", c, 0.5 * opa @ opb, TOL["f32"])
    c0 = rng.standard_normal((200, 136)).astype(np.float32)
    c = dev(c0)
    gemm(c, dev_bf16(a), dev_bf16(b), trans_a=True, alpha=-2.0, accumulate=True, version=version)
    check(f"gemm_{version}_split{splits}_accumulate", c, c0 - 2.0 * opa @ opb, TOL["f32"])


DYNAMIC = {dynamic: static for static, dynamic in DYNAMIC_TWINS.items()}  # the versions that claim tiles: their twins


def run_gemm(ops, version, layout, a, b, c0, mode):
    """c = op(a) @ op(b) (mode 'bf16', 'f32') or c0 - 2 op(a) @ op(b) ('acc_f32') on `version`: c's bits."""
    from llama.runtime.cuda import BF16
    c = dev(c0) if mode == "acc_f32" else poisoned(c0.shape, BF16 if mode == "bf16" else np.float32)
    ops.gemm(c, a, b, trans_a=layout == "tn", trans_b=layout == "nt", alpha=-2.0 if mode == "acc_f32" else 0.5,
             accumulate=mode == "acc_f32", version=version)
    return c.download().view(np.uint16 if mode == "bf16" else np.uint32)


@pytest.mark.parametrize("dynamic", list(DYNAMIC))
@pytest.mark.parametrize("layout, M, N, K, batch, mode, splits", [
    ("nt", 2000, 2056, 776, 1, "bf16", None),  # 272 tiles of 128 x 128, 144 of 128 x 256: not a multiple of the SMs
    ("nt", 4000, 4104, 264, 1, "f32", None),   # 1056 and 544 tiles: several claims per CTA
    ("nn", 1000, 136, 768, 1, "bf16", None),   # 16 tiles: fewer than the SMs
    ("nn", 2000, 1032, 776, 3, "f32", None),   # batched: 432 and 240 tiles
    ("tn", 1000, 1032, 4096, 1, "acc_f32", 3),  # version 8: 216 split-K units (72 tiles x 3 splits)
    ("tn", 768, 768, 16384, 1, "acc_f32", None)])  # d768 attn-out dW: the split count of the model
def test_dynamic_claiming_is_bit_identical(ops, monkeypatch, dynamic, layout, M, N, K, batch, mode, splits):
    """Versions 7 and 8 (tiles claimed at run time, in whatever order) give their static twins' bits: each tile
    is still one CTA's, over K in the same order."""
    runs_on_this_gpu(dynamic)
    if splits is not None:
        monkeypatch.setattr(importlib.import_module("llama.ops.gemm"), "splitk_splits3", lambda p, sms: splits)
    a, b = (dev_bf16(x) for x in operands(layout, M, N, K, batch)[:2])
    c0 = rng.standard_normal(((batch,) if batch > 1 else ()) + (M, N)).astype(np.float32)
    static = run_gemm(ops, DYNAMIC[dynamic], layout, a, b, c0, mode)
    assert np.array_equal(run_gemm(ops, dynamic, layout, a, b, c0, mode), static), f"{dynamic} != {DYNAMIC[dynamic]}"


@pytest.mark.parametrize("version", list(DYNAMIC))
def test_dynamic_claiming_counter_resets(ops, version):
    """Versions 7 and 8 share one tile counter: launches back to back (different tile counts, no synchronization
    between them) each find it at zero and leave it there, so the same GEMM gives the same bits the second
    time, and a captured graph replays them."""
    runs_on_this_gpu(version)
    from llama.runtime.cuda import Graph
    from llama.ops.gemm_wgmma import tile_counter
    shapes = [(2000, 2056, 776), (17, 136, 72), (4000, 4104, 264)]
    operand_sets = [tuple(dev_bf16(x) for x in operands("nt", M, N, K, 1)[:2]) for M, N, K in shapes]
    inputs = operand_sets + operand_sets[:1]  # the first GEMM again, last
    outputs = [poisoned((M, N)) for M, N, K in shapes + shapes[:1]]

    def launch_all():
        for (a, b), c in zip(inputs, outputs):
            ops.gemm(c, a, b, trans_b=True, version=version)

    launch_all()  # compiles, encodes the maps and allocates the counter before the capture
    first = [c.download().view(np.uint32) for c in outputs]
    assert np.array_equal(first[0], first[-1]), "the same GEMM twice in a row differs"
    assert tile_counter().download()[0] == 0, "the counter was not left at zero"
    for (a, b), c, expected in zip(inputs, outputs, first):
        ops.gemm(c, a, b, trans_b=True, version=DYNAMIC[version])
        assert np.array_equal(c.download().view(np.uint32), expected), f"{version} != {DYNAMIC[version]}"
    graph = Graph(launch_all)
    for _ in range(3):
        for c in outputs:
            c.upload(np.full(c.shape, np.nan, np.float32))
        graph.replay()
        for c, expected in zip(outputs, first):
            assert np.array_equal(c.download().view(np.uint32), expected), "a graph replay differs"
    assert tile_counter().download()[0] == 0


@pytest.mark.parametrize("version", list(DYNAMIC))
def test_dynamic_claiming_takes_its_tiles_from_the_counter(ops, version):
    """With the counter preset past the last unit, every claim fails: each CTA runs only its first tile (its block
    index), and the tiles past the grid stay poisoned. A kernel that ignored the counter would write them all.
    9 x 16 tiles of 128 x 128 (too few for version 7's wide tiles; a bf16 c, so version 8 does not split K)."""
    runs_on_this_gpu(version)
    from llama.runtime.cuda import BF16
    from llama.ops.common import multiprocessors
    from llama.ops.gemm_wgmma import tile_counter
    M, N, K, units, grid = 9 * 128, 16 * 128, 264, 9 * 16, multiprocessors()
    if grid >= units:
        pytest.skip(f"{grid} multiprocessors run all {units} tiles at once")
    a, b = (dev_bf16(x) for x in operands("nt", M, N, K, 1)[:2])
    full, c = poisoned((M, N), BF16), poisoned((M, N), BF16)
    ops.gemm(full, a, b, trans_b=True, version=version)  # compiles, allocates the counter
    tile_counter().upload(np.array([units], np.uint32))
    ops.gemm(c, a, b, trans_b=True, version=version)
    left = int(tile_counter().download()[0])
    tile_counter().fill_zero()
    assert left == units + grid, "each CTA claims once, and no claim resets the counter"
    written, reference = c.download().astype(np.float32), full.download().astype(np.float32)
    assert np.isfinite(reference).all()
    tiles = np.isfinite(written).reshape(9, 128, 16, 128).any(axis=(1, 3))
    assert tiles.sum() == grid, "tiles written besides each CTA's first"
    assert np.array_equal(written[np.isfinite(written)], reference[np.isfinite(written)])


def test_gemm_deterministic(gemm, version):
    for layout in ("nt", "nn", "tn"):
        a, b, _, _ = operands(layout, 1000, 1032, 2048, 1)
        a, b = dev_bf16(a), dev_bf16(b)
        results = []
        for _ in range(2):
            c = poisoned((1000, 1032))
            gemm(c, a, b, trans_a=layout == "tn", trans_b=layout == "nt", version=version)
            results.append(c.download().view(np.uint32))
        assert np.array_equal(*results), f"{layout}: two runs differ"


def test_gemm_rejects_bad_inputs(ops):
    from llama.runtime.cuda import BF16
    with pytest.raises(ValueError, match="rows of a multiple of 8"):
        ops.gemm(poisoned((17, 8)), dev_bf16(np.ones((12, 17))), dev_bf16(np.ones((12, 8))), trans_a=True, version="mma")
    with pytest.raises(ValueError, match="b: expected bfloat16"):
        ops.gemm(poisoned((4, 8)), dev_bf16(np.ones((4, 8))), dev(np.ones((8, 8))), trans_b=True, version="mma")
    with pytest.raises(ValueError, match="fp32 to accumulate"):
        ops.gemm(poisoned((4, 8), BF16), dev_bf16(np.ones((4, 8))), dev_bf16(np.ones((8, 8))), accumulate=True,
                 version="mma")
    with pytest.raises(ValueError, match="16-byte aligned"):
        a = dev_bf16(np.ones((5, 16)))
        ops.gemm(poisoned((4, 8)), a.view(1, (4, 16)), dev_bf16(np.ones((8, 16))), trans_b=True, version="mma")
