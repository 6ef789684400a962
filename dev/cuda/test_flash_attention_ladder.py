"""Every rung of the flash attention ladder (dev/cuda/flash_attention_ladder.py's Build.rung: v1; v2 =
kernels/flash_attention.cu; v3 to v6 = kernels/flash_attention_wgmma.cu with their forwards, Hopper only, v4 with the
fused dQ), checked by the production builds' own tests (tests/gpu/test_flash_attention.py, imported here with the
rungs as the fixtures `build` and `masked_build`: against the float64 reference, determinism, the fused inverse
RoPE, no allocation growing with T, several query tiles per CTA, the document mask on v2 to v6), and by the ladder's
own: v1's and v4's opt-in nondeterministic backward, v5's, v6's and the production Hopper build's forward bit for bit
v3's, and which forwards are persistent."""

import numpy as np
import pytest

from dev.cuda.flash_attention_ladder import FIRST_DOCUMENT_MASK_VERSION, VERSIONS, Build, atomic_dq_backward
from llama.runtime.cuda import BF16
from llama.twins.flash_attention import flash_attention_backward, flash_attention_forward
from tests.gpu.test_flash_attention import (  # noqa: F401  (the production builds' tests, run here on the rungs)
    MANY_TILES, bf16_randn, bits, check_dqkv, device_mask, document_rows, rope_tables, run_backward, run_forward,
    runs_here, scratch, test_flash_attention, test_flash_attention_allocates_nothing,
    test_flash_attention_backward_fused_rope, test_flash_attention_deterministic, test_flash_attention_document_mask,
    test_one_document_per_row_is_the_unmasked_kernel, test_packed_documents_are_each_document_alone,
    test_several_query_tiles_per_cta, to_bf16)
from tests.gpu_helpers import dev, poisoned

pytestmark = pytest.mark.gpu
PRODUCTION = "production"  # the Hopper build the plan runs: v6's forward at D = 64, v3's at 128


def rung(version) -> Build:
    """Build.rung(version), or for PRODUCTION the plan's Hopper build; skipped where it cannot run."""
    if version == PRODUCTION:
        from llama.run.plan import ATTENTION_HOPPER
        return runs_here(Build(ATTENTION_HOPPER[0]))
    return runs_here(Build.rung(version))


@pytest.fixture(params=VERSIONS, ids=lambda v: f"v{v}")
def build(request):
    return rung(request.param)


@pytest.fixture(params=[v for v in VERSIONS if v >= FIRST_DOCUMENT_MASK_VERSION], ids=lambda v: f"v{v}")
def masked_build(request):
    return rung(request.param)


@pytest.mark.parametrize("version", [v for v in VERSIONS if Build.rung(v).nondeterministic_backward])
@pytest.mark.parametrize("D", [64, 128])
def test_nondeterministic_backward(D, version):
    """The opt-in nondeterministic backward that scripts/bench_attention.py times against the deterministic one
    (v1: dQ by fp32 atomics, dev/cuda/flash_attention_v1.cu; v4: the fused dQ partials added unordered) computes
    the same gradients."""
    from llama.runtime.cuda import empty
    build = rung(version)
    B, T, H, KV = 2, 333, 4, 1
    cos, sin = rope_tables(T, H, KV, D)
    qkv, dout = bf16_randn(B, T, (H + 2 * KV) * D), bf16_randn(B, T, H * D)
    qkv_d = to_bf16(qkv)
    out, lse = run_forward(build, qkv_d, B, T, H, KV, D)
    if build.fused_dq:
        dqkv = run_backward(build, to_bf16(dout), out, lse, qkv_d, H, KV, dev(cos), dev(sin), deterministic=False)
    else:
        dqkv = poisoned(qkv_d.shape, BF16)
        atomic_dq_backward(build, dqkv, scratch(build, qkv_d.shape, H, KV), empty((B, T, H, D)), to_bf16(dout), out,
                           lse, qkv_d, H, KV, dev(cos), dev(sin))
    ref_out, ref_lse = flash_attention_forward(qkv, H, KV)
    expected = flash_attention_backward(dout, ref_out, ref_lse, qkv, H, KV, cos, sin)
    check_dqkv(f"{build.name}_backward_nondeterministic", dqkv, expected, H, KV, D, T)


@pytest.mark.parametrize("version", [5, 6, PRODUCTION])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B, T, H, KV", [(3, 2000, 4, 2), MANY_TILES])  # query tiles of 1 to 16 kv tiles; MANY_TILES
def test_forward_schedules_are_v3s_bit_for_bit(B, T, H, KV, D, masked, version):
    """v5 changes when its two consumer warpgroups issue their GEMMs (and the registers setmaxnreg gives them), v6
    also which CTA runs which query tile (a CTA per SM, looping over them) and when their loads are issued, not what
    they compute: their out and lse are v3's bits, plain causal and document-masked, with T not a multiple of the
    tiles; so are the production build's (v6's forward at D = 64, v3's at 128)."""
    qkv_d = to_bf16(bf16_randn(B, T, (H + 2 * KV) * D))
    mask = device_mask(document_rows(B, T)) if masked else {}
    v3, other = ([bits(a) for a in run_forward(rung(v), qkv_d, B, T, H, KV, D, **mask)] for v in (3, version))
    for name, expected, got in zip(("out", "lse"), v3, other):
        assert np.array_equal(expected, got), f"{name}: {version}'s forward differs from v3's"


@pytest.mark.parametrize("version, persistent", [(1, {64: False, 128: False}), (2, {64: False, 128: False}),
                                                 (3, {64: False, 128: False}), (4, {64: False, 128: False}),
                                                 (5, {64: False, 128: False}), (6, {64: True, 128: True}),
                                                 (PRODUCTION, {64: True, 128: False})])
def test_which_forwards_are_persistent(version, persistent):
    """The launch table each rung compiles says where its forward is persistent (a CTA per SM): v6 at both head
    dims, production at D = 64 only (at 128 the persistent forward measured slower: dev/cuda/README.md), the
    others never."""
    from llama.ops.flash_attention import flash_config
    source = rung(version).source
    assert {D: flash_config(source, D, "forward").persistent for D in (64, 128)} == persistent
