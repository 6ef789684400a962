"""bf16 flash attention, the builds the plan runs (kernels/flash_attention.cu on mma.sync, the ladder's v2;
kernels/flash_attention_wgmma.cu on Hopper: v6's persistent forward at D = 64, v3's forward at 128 and v3's
backward), against the float64 reference of the same bf16-rounded inputs: O, LSE, dQ, dK, dV at GQA ratios 1, 2, 4,
8, T = 1, 17, 128, 1000, 2048, 8192, D = 64 and 128, B = 1 and 3; outputs NaN-poisoned first; determinism, the
fused inverse RoPE, no allocation growing with T, several query tiles per persistent CTA. The document mask: against
the float64 document-masked reference, bit for bit the unmasked kernels with one document per row, and each packed
document's results those of the unmasked kernels on it alone.

Every rung of the dev/cuda ladder runs these same tests (dev/cuda/test_flash_attention_ladder.py imports them with
its rungs as the fixtures `build` and `masked_build`); a build is what the tests launch: name, scratch_size(B, T, H,
D), forward and backward (ops.flash_attention_forward's and _backward's arguments but the source)."""

import functools
from types import SimpleNamespace

import numpy as np
import pytest

from llama.config import get_preset
from llama.runtime.cuda import BF16
from llama.model.base import rope_cos_sin
from llama.twins.attention import document_bounds, document_ids
from llama.twins.flash_attention import flash_attention_backward, flash_attention_forward
from tests.gpu_helpers import ERRORS, check, dev, poisoned

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(2024)
TOL = 1e-2

# (B, T, H, KV): every T, both B, ratios H/KV 1, 2, 4, 8; few heads where the float64 reference is large
CASES = [(1, 1, 8, 1), (3, 17, 4, 2), (3, 128, 2, 2), (1, 128, 8, 1), (1, 1000, 4, 1), (3, 1000, 4, 2),
         (1, 2048, 2, 1), (1, 8192, 1, 1)]


def production(source) -> SimpleNamespace:
    """A production build as the tests launch it (the dev/cuda ladder's Build has the same face)."""
    from llama import ops
    return SimpleNamespace(name=source.module, source=source,
                           scratch_size=lambda B, T, H, D: ops.flash_attention_scratch_size(B, T, H, D, source),
                           forward=functools.partial(ops.flash_attention_forward, source=source),
                           backward=functools.partial(ops.flash_attention_backward, source=source))


def runs_here(build):
    """build, which the test takes; skipped where it cannot run (the wgmma builds need sm_90a)."""
    from llama.runtime.cuda import runtime
    if build.source.tma and runtime().code != "sm_90a":
        pytest.skip(f"{build.name} is built for Hopper (sm_90a) only")
    return build


def production_build(name: str):
    from llama.run.plan import ATTENTION, ATTENTION_HOPPER
    return runs_here(production({"mma": ATTENTION, "wgmma": ATTENTION_HOPPER}[name][0]))


@pytest.fixture(params=["mma", "wgmma"])
def build(request):
    return production_build(request.param)


@pytest.fixture(params=["mma", "wgmma"])
def masked_build(request):
    """The builds with the document mask (every production build)."""
    return production_build(request.param)


def bf16_randn(*shape) -> np.ndarray:
    """Random values already rounded to bf16, held in float64 (the reference's inputs)."""
    return rng.standard_normal(shape).astype(BF16).astype(np.float64)


def to_bf16(x: np.ndarray):
    from llama.runtime.cuda import to_device
    return to_device(x.astype(BF16))


def run_forward(build, qkv_d, B, T, H, KV, D, **mask):
    """out, lse of the flash forward; mask: doc_start=, doc_end= (device arrays) or nothing."""
    out, lse = poisoned((B, T, H * D), BF16), poisoned((B, H, T))
    build.forward(out, lse, qkv_d, H, KV, **mask)
    return out, lse


def scratch(build, qkv_shape, H, KV):
    """The backward's scratch, NaN-poisoned (a build that accumulates into it must zero it first)."""
    B, T, C = qkv_shape
    return poisoned((build.scratch_size(B, T, H, C // (H + 2 * KV)),))


def run_backward(build, dout_d, out, lse, qkv_d, H, KV, cos=None, sin=None, **options):
    """dqkv of the flash backward; options: the document mask, or a ladder rung's deterministic=."""
    dqkv = poisoned(qkv_d.shape, BF16)
    build.backward(dqkv, scratch(build, qkv_d.shape, H, KV), dout_d, out, lse, qkv_d, H, KV, cos, sin, **options)
    return dqkv


def check_dqkv(name, dqkv, expected, H, KV, D, T):
    """dQ, dK, dV slices of dqkv each against the reference. At T = 1 dQ and dK are zero in exact
    arithmetic (one key: the softmax is constant), so there they must be tiny next to dV."""
    got = dqkv.download().astype(np.float64)
    assert np.isfinite(got).all(), f"{name}: dqkv has NaN/inf (unwritten elements?)"
    parts = {"dq": slice(0, H * D), "dk": slice(H * D, (H + KV) * D), "dv": slice((H + KV) * D, None)}
    for part, cols in parts.items():
        if T == 1 and part != "dv":
            assert np.abs(got[..., cols]).max() <= 1e-3 * np.abs(expected[..., parts["dv"]]).max(), part
            continue
        err = float(np.linalg.norm(got[..., cols] - expected[..., cols]) / np.linalg.norm(expected[..., cols]))
        ERRORS.append((f"{name}_{part}", err))
        assert err <= TOL, f"{name}_{part}: relative error {err:.3e} > {TOL}"


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B, T, H, KV", CASES)
def test_flash_attention(build, B, T, H, KV, D):
    qkv, dout = bf16_randn(B, T, (H + 2 * KV) * D), bf16_randn(B, T, H * D)
    qkv_d = to_bf16(qkv)
    out, lse = run_forward(build, qkv_d, B, T, H, KV, D)
    ref_out, ref_lse = flash_attention_forward(qkv, H, KV)
    check(f"{build.name}_forward_out", out, ref_out, tol=TOL)
    check(f"{build.name}_forward_lse", lse, ref_lse, tol=TOL)
    dqkv = run_backward(build, to_bf16(dout), out, lse, qkv_d, H, KV)
    expected = flash_attention_backward(dout, ref_out, ref_lse, qkv, H, KV)
    check_dqkv(f"{build.name}_backward", dqkv, expected, H, KV, D, T)


def rope_tables(T: int, H: int, KV: int, D: int) -> tuple[np.ndarray, np.ndarray]:
    """RoPE's cos, sin (T, D / 2) at these heads, fp32 values held in float64."""
    config = get_preset("llama3.1-8b").replace(dim=H * D, n_heads=H, n_kv_heads=KV)
    return tuple(x.astype(np.float32).astype(np.float64) for x in rope_cos_sin(config, T))


@pytest.mark.parametrize("D", [64, 128])
def test_flash_attention_backward_fused_rope(build, D):
    B, T, H, KV = 2, 300, 4, 1
    cos, sin = rope_tables(T + 5, H, KV, D)
    qkv, dout = bf16_randn(B, T, (H + 2 * KV) * D), bf16_randn(B, T, H * D)
    qkv_d = to_bf16(qkv)
    out, lse = run_forward(build, qkv_d, B, T, H, KV, D)
    dqkv = run_backward(build, to_bf16(dout), out, lse, qkv_d, H, KV, dev(cos), dev(sin))
    ref_out, ref_lse = flash_attention_forward(qkv, H, KV)
    expected = flash_attention_backward(dout, ref_out, ref_lse, qkv, H, KV, cos, sin)
    check_dqkv(f"{build.name}_backward_rope", dqkv, expected, H, KV, D, T)


@pytest.mark.parametrize("D", [64, 128])
def test_flash_attention_deterministic(build, D):
    B, T, H, KV = 2, 777, 8, 2
    qkv_d, dout_d = to_bf16(bf16_randn(B, T, (H + 2 * KV) * D)), to_bf16(bf16_randn(B, T, H * D))
    runs = []
    for _ in range(2):
        out, lse = run_forward(build, qkv_d, B, T, H, KV, D)
        dqkv = run_backward(build, dout_d, out, lse, qkv_d, H, KV)
        runs.append([bits(a) for a in (out, lse, dqkv)])
    for name, first, second in zip(("out", "lse", "dqkv"), *runs):
        assert np.array_equal(first, second), f"{name} differs between two runs on the same inputs"


def test_flash_attention_allocates_nothing(build):
    """At T = 16384 a (B, H, T, T) tensor would take GBs: the launchers take preallocated buffers and the
    kernels must leave free device memory as it was, but for the wgmma build's TMA maps (256 bytes per
    new set of buffers, within one 2 MiB allocation granule)."""
    from llama.runtime.cuda import runtime, zeros
    H, KV, D = 4, 1, 128

    def buffers(T):
        shapes = {"qkv": (1, T, (H + 2 * KV) * D), "out": (1, T, H * D), "dout": (1, T, H * D),
                  "dqkv": (1, T, (H + 2 * KV) * D)}
        arrays = {name: zeros(shape, BF16) for name, shape in shapes.items()}
        return arrays | {"lse": zeros((1, H, T)), "scratch": zeros((build.scratch_size(1, T, H, D),))}

    def step(a):
        build.forward(a["out"], a["lse"], a["qkv"], H, KV)
        build.backward(a["dqkv"], a["scratch"], a["dout"], a["out"], a["lse"], a["qkv"], H, KV)
        runtime().synchronize()

    step(buffers(8))  # loads the module and its kernels
    big = buffers(16384)
    free_before, _ = runtime().drv.mem_get_info()
    step(big)
    free_after, _ = runtime().drv.mem_get_info()
    assert free_before - free_after <= 2 * 2**20
    assert np.isfinite(big["out"].download().astype(np.float32)).all()


# ---- the document mask

BOS = 128000
# documents of length 1, shorter than every tile, at and around the tile sizes (32, 64, 128), longer
DOCUMENT_LENGTHS = [1, 1, 2, 7, 31, 64, 65, 127, 128, 129, 200, 1, 333]
# (B, T, H, KV): T = 1, T not a multiple of any tile, GQA ratios 1, 2, 4, 8
MASK_CASES = [(3, 1, 2, 1), (3, 77, 4, 4), (3, 1000, 4, 2), (3, 700, 8, 1), (1, 2048, 4, 1)]


def document_rows(B: int, T: int) -> np.ndarray:
    """Token rows (B, T) of three document layouts in turn: documents of DOCUMENT_LENGTHS (repeated) from a BOS at 0;
    no BOS at all (one document fills the row); a row that starts mid-document, BOS at T // 7 and the next position
    (a document of length 1), and at T // 2. Only where the BOS are matters."""
    tokens = np.zeros((B, T), dtype=np.int32)
    starts = np.cumsum([0] + DOCUMENT_LENGTHS * (T // sum(DOCUMENT_LENGTHS) + 1))
    layouts = [starts, [], [T // 7, T // 7 + 1, T // 2]]
    for b in range(B):
        positions = np.asarray(layouts[b % 3], dtype=np.int64)
        tokens[b, positions[positions < T]] = BOS
    return tokens


def device_mask(tokens: np.ndarray) -> dict:
    """doc_start, doc_end of token rows on the device (the bounds kernel has its own test: the twin's here)."""
    return dict(zip(("doc_start", "doc_end"), (dev(x) for x in document_bounds(tokens, BOS))))


def masked_problem(build, B, T, H, KV, D, tokens):
    """The masked forward and backward of random inputs: (qkv, dout, out, lse, dqkv) with the kernels' results on
    the device."""
    qkv, dout = bf16_randn(B, T, (H + 2 * KV) * D), bf16_randn(B, T, H * D)
    qkv_d, mask = to_bf16(qkv), device_mask(tokens)
    out, lse = run_forward(build, qkv_d, B, T, H, KV, D, **mask)
    dqkv = run_backward(build, to_bf16(dout), out, lse, qkv_d, H, KV, **mask)
    return qkv, dout, out, lse, dqkv


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B, T, H, KV", MASK_CASES)
def test_flash_attention_document_mask(masked_build, B, T, H, KV, D):
    build = masked_build
    tokens = document_rows(B, T)
    qkv, dout, out, lse, dqkv = masked_problem(build, B, T, H, KV, D, tokens)
    doc_ids = document_ids(tokens, BOS)
    ref_out, ref_lse = flash_attention_forward(qkv, H, KV, doc_ids)
    check(f"{build.name}_document_out", out, ref_out, tol=TOL)
    check(f"{build.name}_document_lse", lse, ref_lse, tol=TOL)
    expected = flash_attention_backward(dout, ref_out, ref_lse, qkv, H, KV, doc_ids=doc_ids)
    check_dqkv(f"{build.name}_document_backward", dqkv, expected, H, KV, D, T)


def bits(array) -> np.ndarray:
    return array.download().view(np.uint16 if array.dtype == BF16 else np.uint32)


# (B, T, H, KV): 576 query tiles of 1 to 3 kv tiles, 4 or more per CTA of a persistent forward on a GPU of at most
# 144 SMs (an H100 or H200 has 132), so that its Q buffers and rings go round several times
MANY_TILES = (3, 300, 64, 8)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_several_query_tiles_per_cta(masked_build, D, masked):
    """MANY_TILES, where a persistent forward's CTAs (the Hopper build's at D = 64) each take several query tiles:
    out and lse against the float64 reference, plain causal and document-masked, outputs poisoned first (a tile no
    CTA takes stays NaN)."""
    build = masked_build
    B, T, H, KV = MANY_TILES
    qkv = bf16_randn(B, T, (H + 2 * KV) * D)
    tokens = document_rows(B, T)
    mask = device_mask(tokens) if masked else {}
    out, lse = run_forward(build, to_bf16(qkv), B, T, H, KV, D, **mask)
    ref_out, ref_lse = flash_attention_forward(qkv, H, KV, document_ids(tokens, BOS) if masked else None)
    check(f"{build.name}_many_tiles_out{'_masked' * masked}", out, ref_out, tol=TOL)
    check(f"{build.name}_many_tiles_lse{'_masked' * masked}", lse, ref_lse, tol=TOL)


@pytest.mark.parametrize("name, persistent", [("mma", {64: False, 128: False}), ("wgmma", {64: True, 128: False})])
def test_which_forwards_are_persistent(name, persistent):
    """The launch table each build compiles says where its forward is persistent (a CTA per SM): the Hopper build at
    D = 64 only (at 128 the persistent forward measured slower: dev/cuda/README.md), the mma.sync build never."""
    from llama.ops.flash_attention import flash_config
    source = production_build(name).source
    assert {D: flash_config(source, D, "forward").persistent for D in (64, 128)} == persistent


@pytest.mark.parametrize("D", [64, 128])
def test_one_document_per_row_is_the_unmasked_kernel(masked_build, D):
    """Every row one document (from a BOS at 0, or no BOS): out, lse and dqkv bit for bit the plain causal ones."""
    build = masked_build
    B, T, H, KV = 2, 1000, 4, 2
    tokens = np.zeros((B, T), dtype=np.int32)
    tokens[0, 0] = BOS
    qkv_d, dout_d = to_bf16(bf16_randn(B, T, (H + 2 * KV) * D)), to_bf16(bf16_randn(B, T, H * D))
    runs = []
    for mask in ({}, device_mask(tokens)):
        out, lse = run_forward(build, qkv_d, B, T, H, KV, D, **mask)
        dqkv = run_backward(build, dout_d, out, lse, qkv_d, H, KV, **mask)
        runs.append([bits(a) for a in (out, lse, dqkv)])
    for name, plain, masked in zip(("out", "lse", "dqkv"), *runs):
        assert np.array_equal(plain, masked), f"{name}: one document per row differs from the unmasked kernel"


def documents(tokens: np.ndarray):
    """(b, start, end) of every document of token rows."""
    doc_ids = document_ids(tokens, BOS)
    for b, row in enumerate(doc_ids):
        for doc in np.unique(row):
            positions = np.flatnonzero(row == doc)
            yield b, int(positions[0]), int(positions[-1]) + 1


@pytest.mark.parametrize("D", [64, 128])
def test_packed_documents_are_each_document_alone(masked_build, D):
    """The issue's check: the masked kernels' out, lse and dqkv on packed rows are the unmasked kernels' on each
    document by itself (within the tolerance: the tiles split a document differently)."""
    build = masked_build
    B, T, H, KV = 3, 1000, 4, 2
    tokens = document_rows(B, T)
    qkv, dout, out, lse, dqkv = masked_problem(build, B, T, H, KV, D, tokens)
    alone = {"out": np.zeros((B, T, H * D)), "lse": np.zeros((B, H, T)), "dqkv": np.zeros(qkv.shape)}
    for b, start, end in documents(tokens):
        doc = slice(start, end)
        qkv_d = to_bf16(qkv[b:b + 1, doc])
        doc_out, doc_lse = run_forward(build, qkv_d, 1, end - start, H, KV, D)
        doc_dqkv = run_backward(build, to_bf16(dout[b:b + 1, doc]), doc_out, doc_lse, qkv_d, H, KV)
        alone["out"][b, doc] = doc_out.download().astype(np.float64)[0]
        alone["lse"][b, :, doc] = doc_lse.download()[0]
        alone["dqkv"][b, doc] = doc_dqkv.download().astype(np.float64)[0]
    check(f"{build.name}_alone_out", out, alone["out"], tol=TOL)
    check(f"{build.name}_alone_lse", lse, alone["lse"], tol=TOL)
    check_dqkv(f"{build.name}_alone_backward", dqkv, alone["dqkv"], H, KV, D, T)
