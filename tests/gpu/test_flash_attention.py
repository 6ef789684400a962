"""bf16 flash attention, every rung of the dev/cuda ladder (v1; v2 = kernels/flash_attention.cu; v3, v4 =
kernels/flash_attention_wgmma.cu, Hopper only, v4 with the fused dQ; v5 = v3 with the ping-pong forward; v6 = v5 with
a persistent forward) against the float64 reference of the same bf16-rounded inputs: O, LSE, dQ, dK, dV at GQA ratios
1, 2, 4, 8, T = 1, 17, 128, 1000, 2048, 8192, D = 64 and 128, B = 1 and 3; outputs NaN-poisoned first; determinism,
the fused inverse RoPE, no allocation growing with T; v5's, v6's and the production Hopper build's forward bit for
bit v3's, and v6's with several query tiles per CTA against the reference. The document mask on the production
builds (v2, v3, v4), v5 and v6: against the float64 document-masked reference, bit for bit the unmasked kernels
with one document per row, and each packed document's results those of the unmasked kernels on it alone."""

import numpy as np
import pytest

from dev.cuda.flash_attention_ladder import LADDER, flash_attention_backward_atomic_dq
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


VERSIONS = [1, 2, 3, 4, 5, 6]  # v2 to v6 include the production builds (flash_attention.cu, flash_attention_wgmma.cu)
NONDETERMINISTIC_VERSIONS = [1, 4]  # the rungs with an opt-in nondeterministic backward (atomic or unordered dQ)


@pytest.fixture(scope="module")
def ops():
    from llama import ops
    return ops


PRODUCTION = "production"  # the Hopper build the plan runs (kernels/flash_attention_wgmma.cu): v6's forward at D = 64


def flash_source(ops, version):
    from llama.runtime.cuda import runtime
    from llama.run.plan import ATTENTION_HOPPER
    source = ATTENTION_HOPPER[0] if version == PRODUCTION else ops.FlashSource.ladder(version, LADDER)
    if source.tma and runtime().code != "sm_90a":
        pytest.skip(f"flash attention v{version} is built for Hopper (sm_90a) only")
    return source


def bf16_randn(*shape) -> np.ndarray:
    """Random values already rounded to bf16, held in float64 (the reference's inputs)."""
    return rng.standard_normal(shape).astype(BF16).astype(np.float64)


def to_bf16(x: np.ndarray):
    from llama.runtime.cuda import to_device
    return to_device(x.astype(BF16))


def run_forward(ops, qkv_d, B, T, H, KV, D, version=VERSIONS[-1], **mask):
    """out, lse of the flash forward; mask: doc_start=, doc_end= (device arrays) or nothing."""
    out, lse = poisoned((B, T, H * D), BF16), poisoned((B, H, T))
    ops.flash_attention_forward(out, lse, qkv_d, H, KV, source=flash_source(ops, version), **mask)
    return out, lse


def scratch(ops, qkv_shape, H, KV, source):
    """The backward's scratch, NaN-poisoned (the fused build must zero what it accumulates into)."""
    B, T, C = qkv_shape
    return poisoned((ops.flash_attention_scratch_size(B, T, H, C // (H + 2 * KV), source),))


def run_backward(ops, dout_d, out, lse, qkv_d, H, KV, cos=None, sin=None, version=VERSIONS[-1], deterministic=True,
                 **mask):
    source = flash_source(ops, version)
    dqkv = poisoned(qkv_d.shape, BF16)
    ops.flash_attention_backward(dqkv, scratch(ops, qkv_d.shape, H, KV, source), dout_d, out, lse, qkv_d, H, KV,
                                 cos, sin, source=source, deterministic=deterministic, **mask)
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


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B, T, H, KV", CASES)
def test_flash_attention(ops, B, T, H, KV, D, version):
    qkv, dout = bf16_randn(B, T, (H + 2 * KV) * D), bf16_randn(B, T, H * D)
    qkv_d = to_bf16(qkv)
    out, lse = run_forward(ops, qkv_d, B, T, H, KV, D, version)
    ref_out, ref_lse = flash_attention_forward(qkv, H, KV)
    check(f"flash_attention_v{version}_forward_out", out, ref_out, tol=TOL)
    check(f"flash_attention_v{version}_forward_lse", lse, ref_lse, tol=TOL)
    dqkv = run_backward(ops, to_bf16(dout), out, lse, qkv_d, H, KV, version=version)
    expected = flash_attention_backward(dout, ref_out, ref_lse, qkv, H, KV)
    check_dqkv(f"flash_attention_v{version}_backward", dqkv, expected, H, KV, D, T)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("D", [64, 128])
def test_flash_attention_backward_fused_rope(ops, D, version):
    B, T, H, KV = 2, 300, 4, 1
    config = get_preset("llama3.1-8b").replace(dim=H * D, n_heads=H, n_kv_heads=KV)
    cos, sin = (x.astype(np.float32).astype(np.float64) for x in rope_cos_sin(config, T + 5))
    qkv, dout = bf16_randn(B, T, (H + 2 * KV) * D), bf16_randn(B, T, H * D)
    qkv_d = to_bf16(qkv)
    out, lse = run_forward(ops, qkv_d, B, T, H, KV, D, version)
    dqkv = run_backward(ops, to_bf16(dout), out, lse, qkv_d, H, KV, dev(cos), dev(sin), version)
    ref_out, ref_lse = flash_attention_forward(qkv, H, KV)
    expected = flash_attention_backward(dout, ref_out, ref_lse, qkv, H, KV, cos, sin)
    check_dqkv(f"flash_attention_v{version}_backward_rope", dqkv, expected, H, KV, D, T)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("D", [64, 128])
def test_flash_attention_deterministic(ops, D, version):
    B, T, H, KV = 2, 777, 8, 2
    qkv_d, dout_d = to_bf16(bf16_randn(B, T, (H + 2 * KV) * D)), to_bf16(bf16_randn(B, T, H * D))
    runs = []
    for _ in range(2):
        out, lse = run_forward(ops, qkv_d, B, T, H, KV, D, version)
        dqkv = run_backward(ops, dout_d, out, lse, qkv_d, H, KV, version=version)
        runs.append([a.download().view(np.uint16) if a.dtype == BF16 else a.download().view(np.uint32)
                     for a in (out, lse, dqkv)])
    for name, first, second in zip(("out", "lse", "dqkv"), *runs):
        assert np.array_equal(first, second), f"{name} differs between two runs on the same inputs"


@pytest.mark.parametrize("version", VERSIONS)
def test_flash_attention_allocates_nothing(ops, version):
    """At T = 16384 a (B, H, T, T) tensor would take GBs: the launchers take preallocated buffers and the
    kernels must leave free device memory as it was, but for the wgmma build's TMA maps (256 bytes per
    new set of buffers, within one 2 MiB allocation granule)."""
    from llama.runtime.cuda import runtime, zeros
    H, KV, D = 4, 1, 128

    def buffers(T):
        shapes = {"qkv": (1, T, (H + 2 * KV) * D), "out": (1, T, H * D), "dout": (1, T, H * D),
                  "dqkv": (1, T, (H + 2 * KV) * D)}
        arrays = {name: zeros(shape, BF16) for name, shape in shapes.items()}
        return arrays | {"lse": zeros((1, H, T)),
                         "scratch": zeros((ops.flash_attention_scratch_size(1, T, H, D, source),))}

    source = flash_source(ops, version)

    def step(a):
        ops.flash_attention_forward(a["out"], a["lse"], a["qkv"], H, KV, source=source)
        ops.flash_attention_backward(a["dqkv"], a["scratch"], a["dout"], a["out"], a["lse"], a["qkv"], H, KV,
                                     source=source)
        runtime().synchronize()

    step(buffers(8))  # loads the module and its kernels
    big = buffers(16384)
    free_before, _ = runtime().drv.mem_get_info()
    step(big)
    free_after, _ = runtime().drv.mem_get_info()
    assert free_before - free_after <= 2 * 2**20
    assert np.isfinite(big["out"].download().astype(np.float32)).all()


@pytest.mark.parametrize("version", NONDETERMINISTIC_VERSIONS)
@pytest.mark.parametrize("D", [64, 128])
def test_flash_attention_nondeterministic_variant(ops, D, version):
    """The opt-in nondeterministic backward that scripts/bench_attention.py times against the deterministic one
    (v1: dQ by fp32 atomics, dev/cuda/flash_attention_v1.cu; v4: the fused dQ partials added unordered) computes
    the same gradients."""
    from llama.runtime.cuda import empty
    B, T, H, KV = 2, 333, 4, 1
    cos, sin = (x.astype(np.float32).astype(np.float64) for x in
                rope_cos_sin(get_preset("llama3.1-8b").replace(dim=H * D, n_heads=H, n_kv_heads=KV), T))
    qkv, dout = bf16_randn(B, T, (H + 2 * KV) * D), bf16_randn(B, T, H * D)
    qkv_d = to_bf16(qkv)
    out, lse = run_forward(ops, qkv_d, B, T, H, KV, D, version)
    source = flash_source(ops, version)
    if source.fused_dq:
        dqkv = run_backward(ops, to_bf16(dout), out, lse, qkv_d, H, KV, dev(cos), dev(sin), version,
                            deterministic=False)
    else:
        dqkv = poisoned(qkv_d.shape, BF16)
        flash_attention_backward_atomic_dq(dqkv, scratch(ops, qkv_d.shape, H, KV, source), empty((B, T, H, D)),
                                               to_bf16(dout), out, lse, qkv_d, H, KV, dev(cos), dev(sin), source=source)
    ref_out, ref_lse = flash_attention_forward(qkv, H, KV)
    expected = flash_attention_backward(dout, ref_out, ref_lse, qkv, H, KV, cos, sin)
    check_dqkv(f"flash_attention_v{version}_backward_nondeterministic", dqkv, expected, H, KV, D, T)


# ---- the document mask

MASK_VERSIONS = [2, 3, 4, 5, 6]  # the production builds: flash_attention.cu, flash_attention_wgmma.cu (v4: fused
# dQ; v5: its ping-pong forward; v6: persistent)
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


def masked_problem(ops, B, T, H, KV, D, version, tokens):
    """The masked forward and backward of random inputs: (qkv, dout, out, lse, dqkv) with the kernels' results on
    the device."""
    qkv, dout = bf16_randn(B, T, (H + 2 * KV) * D), bf16_randn(B, T, H * D)
    qkv_d, mask = to_bf16(qkv), device_mask(tokens)
    out, lse = run_forward(ops, qkv_d, B, T, H, KV, D, version, **mask)
    dqkv = run_backward(ops, to_bf16(dout), out, lse, qkv_d, H, KV, version=version, **mask)
    return qkv, dout, out, lse, dqkv


@pytest.mark.parametrize("version", MASK_VERSIONS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B, T, H, KV", MASK_CASES)
def test_flash_attention_document_mask(ops, B, T, H, KV, D, version):
    tokens = document_rows(B, T)
    qkv, dout, out, lse, dqkv = masked_problem(ops, B, T, H, KV, D, version, tokens)
    doc_ids = document_ids(tokens, BOS)
    ref_out, ref_lse = flash_attention_forward(qkv, H, KV, doc_ids)
    check(f"flash_attention_v{version}_document_out", out, ref_out, tol=TOL)
    check(f"flash_attention_v{version}_document_lse", lse, ref_lse, tol=TOL)
    expected = flash_attention_backward(dout, ref_out, ref_lse, qkv, H, KV, doc_ids=doc_ids)
    check_dqkv(f"flash_attention_v{version}_document_backward", dqkv, expected, H, KV, D, T)


def bits(array) -> np.ndarray:
    return array.download().view(np.uint16 if array.dtype == BF16 else np.uint32)


# (B, T, H, KV): query tiles of 1 to 16 kv tiles; and 576 query tiles of 1 to 3 kv tiles, 4 or more per CTA of v6 on
# a GPU of at most 144 SMs (an H100 or H200 has 132), so that its Q buffers and rings go round several times
MANY_TILES = (3, 300, 64, 8)
SCHEDULE_CASES = [(3, 2000, 4, 2), MANY_TILES]


@pytest.mark.parametrize("version", [5, 6, PRODUCTION])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B, T, H, KV", SCHEDULE_CASES)
def test_forward_schedules_are_v3s_bit_for_bit(ops, B, T, H, KV, D, masked, version):
    """v5 changes when its two consumer warpgroups issue their GEMMs (and the registers setmaxnreg gives them), v6
    also which CTA runs which query tile (a CTA per SM, looping over them) and when their loads are issued, not what
    they compute: their out and lse are v3's bits, plain causal and document-masked, with T not a multiple of the
    tiles; so are the production build's (v6's forward at D = 64, v3's at 128)."""
    qkv_d = to_bf16(bf16_randn(B, T, (H + 2 * KV) * D))
    mask = device_mask(document_rows(B, T)) if masked else {}
    v3, other = ([bits(a) for a in run_forward(ops, qkv_d, B, T, H, KV, D, v, **mask)] for v in (3, version))
    for name, expected, got in zip(("out", "lse"), v3, other):
        assert np.array_equal(expected, got), f"{name}: v{version}'s forward differs from v3's"


@pytest.mark.parametrize("version, persistent", [(1, {64: False, 128: False}), (2, {64: False, 128: False}),
                                                 (3, {64: False, 128: False}), (5, {64: False, 128: False}),
                                                 (6, {64: True, 128: True}), (PRODUCTION, {64: True, 128: False})])
def test_which_forwards_are_persistent(ops, version, persistent):
    """The launch table each build compiles says where its forward is persistent (a CTA per SM): v6 at both head
    dims, production at D = 64 only (at 128 the persistent forward measured slower: dev/cuda/README.md), the
    mma.sync builds (v1, v2) never."""
    from llama.ops.flash_attention import flash_config
    source = flash_source(ops, version)
    assert {D: flash_config(source, D, "forward").persistent for D in (64, 128)} == persistent


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_persistent_forward_with_several_tiles_per_cta(ops, D, masked):
    """v6's CTAs each take several query tiles (MANY_TILES): out and lse against the float64 reference, plain causal
    and document-masked, outputs poisoned first (a tile no CTA takes stays NaN)."""
    B, T, H, KV = MANY_TILES
    qkv = bf16_randn(B, T, (H + 2 * KV) * D)
    tokens = document_rows(B, T)
    mask = device_mask(tokens) if masked else {}
    out, lse = run_forward(ops, to_bf16(qkv), B, T, H, KV, D, 6, **mask)
    ref_out, ref_lse = flash_attention_forward(qkv, H, KV, document_ids(tokens, BOS) if masked else None)
    check(f"flash_attention_v6_persistent_out{'_masked' * masked}", out, ref_out, tol=TOL)
    check(f"flash_attention_v6_persistent_lse{'_masked' * masked}", lse, ref_lse, tol=TOL)


@pytest.mark.parametrize("version", MASK_VERSIONS)
@pytest.mark.parametrize("D", [64, 128])
def test_one_document_per_row_is_the_unmasked_kernel(ops, D, version):
    """Every row one document (from a BOS at 0, or no BOS): out, lse and dqkv bit for bit the plain causal ones."""
    B, T, H, KV = 2, 1000, 4, 2
    tokens = np.zeros((B, T), dtype=np.int32)
    tokens[0, 0] = BOS
    qkv_d, dout_d = to_bf16(bf16_randn(B, T, (H + 2 * KV) * D)), to_bf16(bf16_randn(B, T, H * D))
    runs = []
    for mask in ({}, device_mask(tokens)):
        out, lse = run_forward(ops, qkv_d, B, T, H, KV, D, version, **mask)
        dqkv = run_backward(ops, dout_d, out, lse, qkv_d, H, KV, version=version, **mask)
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


@pytest.mark.parametrize("version", MASK_VERSIONS)
@pytest.mark.parametrize("D", [64, 128])
def test_packed_documents_are_each_document_alone(ops, D, version):
    """The issue's check: the masked kernels' out, lse and dqkv on packed rows are the unmasked kernels' on each
    document by itself (within the tolerance: the tiles split a document differently)."""
    B, T, H, KV = 3, 1000, 4, 2
    tokens = document_rows(B, T)
    qkv, dout, out, lse, dqkv = masked_problem(ops, B, T, H, KV, D, version, tokens)
    alone = {"out": np.zeros((B, T, H * D)), "lse": np.zeros((B, H, T)), "dqkv": np.zeros(qkv.shape)}
    for b, start, end in documents(tokens):
        doc = slice(start, end)
        qkv_d = to_bf16(qkv[b:b + 1, doc])
        doc_out, doc_lse = run_forward(ops, qkv_d, 1, end - start, H, KV, D, version)
        doc_dqkv = run_backward(ops, to_bf16(dout[b:b + 1, doc]), doc_out, doc_lse, qkv_d, H, KV, version=version)
        alone["out"][b, doc] = doc_out.download().astype(np.float64)[0]
        alone["lse"][b, :, doc] = doc_lse.download()[0]
        alone["dqkv"][b, doc] = doc_dqkv.download().astype(np.float64)[0]
    check(f"flash_attention_v{version}_alone_out", out, alone["out"], tol=TOL)
    check(f"flash_attention_v{version}_alone_lse", lse, alone["lse"], tol=TOL)
    check_dqkv(f"flash_attention_v{version}_alone_backward", dqkv, alone["dqkv"], H, KV, D, T)
