"""The bf16 launchers' host side, without a GPU: they reject bad shapes, dtypes and alignment before
launching anything (the arrays here are descriptors of device memory that does not exist), and the
host helpers build what the kernels expect."""

import importlib
import math
from dataclasses import replace

import numpy as np
import pytest

from llama import ops
from llama.ops import gemm_wgmma
from llama.ops.embedding import EMBEDDING_SEGMENT, embedding_partial_rows
from llama.ops.gemm_problem import GemmProblem
from llama.ops.gemm_wgmma import UNIT_RING_BYTES, splitk_splits3
from llama.runtime.cuda import BF16, DeviceArray
from llama.optim import AdamWConfig

F32, I32 = np.float32, np.int32


def fake(shape, dtype=BF16, offset=0):
    """A DeviceArray at a 256-byte aligned address plus offset bytes; nothing is allocated."""
    return DeviceArray(0x10000 + offset, shape, dtype, None)


def test_embedding_rejects():
    with pytest.raises(ValueError, match="wte: expected bfloat16"):
        ops.embedding_forward_bf16(fake((4, 8)), fake((4,), I32), fake((10, 8), F32))
    with pytest.raises(ValueError, match="multiple of 8"):
        ops.embedding_forward_bf16(fake((4, 12)), fake((4,), I32), fake((10, 12)))
    with pytest.raises(ValueError, match="out: must start 16-byte aligned"):
        ops.embedding_forward_bf16(fake((4, 8), offset=2), fake((4,), I32), fake((10, 8)))
    with pytest.raises(ValueError, match="scratch: needs"):
        ops.embedding_backward_bf16(fake((10, 8), F32), fake((4, 8)), fake((4,), I32), fake((4, 4), I32),
                                    fake((8,), F32))
    with pytest.raises(ValueError, match="segments"):
        ops.embedding_backward_bf16(fake((10, 8), F32), fake((4, 8)), fake((4,), I32), fake((3, 4), I32),
                                    fake((ops.embedding_bf16_scratch_size(4, 8),), F32))


def test_rmsnorm_rejects():
    N, C = 5, 64
    w = fake((C,), F32)  # the norms read the fp32 master weight
    with pytest.raises(ValueError, match="both branch and residual_out"):
        ops.rmsnorm_residual_forward_bf16(None, fake((N, C)), fake((N,), F32), fake((N, C)), fake((N, C)), w, 1e-5)
    with pytest.raises(ValueError, match="weight: expected float32"):
        ops.rmsnorm_forward_bf16(fake((N, C)), fake((N,), F32), fake((N, C)), fake((C,)), 1e-5)
    with pytest.raises(ValueError, match="branch: must start 16-byte aligned"):
        ops.rmsnorm_residual_forward_bf16(fake((N, C)), fake((N, C)), fake((N,), F32), fake((N, C)),
                                     fake((N, C), offset=8), w, 1e-5)
    with pytest.raises(ValueError, match="C <= 8192"):
        ops.rmsnorm_forward_bf16(fake((N, 16384)), fake((N,), F32), fake((N, 16384)), fake((16384,), F32), 1e-5)
    with pytest.raises(ValueError, match="scratch: needs"):
        ops.rmsnorm_backward_bf16(fake((N, C)), fake((C,), F32), fake((100,), F32), fake((N, C)), fake((N, C)),
                                  w, fake((N,), F32))
    with pytest.raises(ValueError, match="dweight: expected float32"):
        ops.rmsnorm_backward_bf16(fake((N, C)), fake((C,)), fake((ops.rmsnorm_bf16_scratch_size(C),), F32),
                                  fake((N, C)), fake((N, C)), w, fake((N,), F32))


def test_swiglu_and_classifier_reject():
    with pytest.raises(ValueError, match="multiple of 8"):
        ops.swiglu_forward_bf16(fake((3, 12)), fake((3, 24)))
    with pytest.raises(ValueError, match="gate_up: expected bfloat16 \\(3, 16\\)"):
        ops.swiglu_backward_bf16(fake((3, 16)), fake((3, 8)), fake((3, 8)))
    with pytest.raises(ValueError, match="logits: expected bfloat16"):
        ops.fused_classifier_bf16(fake((3, 50), F32), fake((3,), F32), fake((3,), I32), 1.0)
    with pytest.raises(ValueError, match="targets: expected int32"):
        ops.fused_classifier_bf16(fake((3, 50)), fake((3,), F32), fake((3,), F32), 1.0)
    with pytest.raises(ValueError, match="total"):
        ops.loss_accumulate_bf16(fake((2,), F32), fake((3,), F32), 1.0)
    with pytest.raises(ValueError, match=r"dloss_scale: expected float32 \(1,\)"):
        ops.fused_classifier_bf16(fake((3, 48)), fake((3,), F32), fake((3,), I32), 1.0, dloss_scale=fake((2,), F32))
    with pytest.raises(ValueError, match=r"scale_at: expected float32 \(1,\)"):
        ops.loss_accumulate_bf16(fake((1,), F32), fake((3,), F32), 1.0, scale_at=fake((1,), I32))


def test_grad_norm_and_adamw_reject():
    n = 1000
    with pytest.raises(ValueError, match="scratch: expected float64"):
        ops.global_norm_squared_bf16(fake((1,), F32), fake((ops.NORM_BLOCKS + 1,), F32), fake((n,), F32))
    with pytest.raises(ValueError, match="grads: must start 16-byte aligned"):
        ops.global_norm_squared_bf16(fake((1,), F32), fake((ops.NORM_BLOCKS + 1,), np.float64), fake((n,), F32, 4))
    arrays = dict(params=fake((n,), F32), params_bf16=fake((n,)), grads=fake((n,), F32), m=fake((n,), F32),
                  v=fake((n,), F32), decay_mask=fake((125,), np.uint8), norm_squared=fake((1,), F32),
                  scalars=fake((ops.ADAMW_SCALARS,), F32))
    for name, bad, message in (("params_bf16", fake((n,), F32), "params_bf16: expected bfloat16"),
                               ("scalars", fake((2,), F32), "scalars: expected float32 \\(3,\\)"),
                               ("decay_mask", fake((n,), np.uint8), "decay_mask: expected uint8 \\(125,\\)"),
                               ("m", fake((n,), F32, 8), "m: must start 16-byte aligned")):
        with pytest.raises(ValueError, match=message):
            ops.adamw_update_bf16(**(arrays | {name: bad}), opt=AdamWConfig())


def test_adamw8bit_rejects_and_its_maps_are_the_twins():
    n = 1000
    arrays = dict(params=fake((n,), F32), params_bf16=fake((n,)), grads=fake((n,), F32), m_codes=fake((n,), np.uint8),
                  m_scales=fake((4,), F32), v_codes=fake((n,), np.uint8), v_scales=fake((4,), F32),
                  decay_mask=fake((125,), np.uint8), norm_squared=fake((1,), F32),
                  scalars=fake((ops.ADAMW_SCALARS,), F32), maps=fake((4, 256), F32))
    for name, bad, message in (("m_scales", fake((3,), F32), "m_scales: expected float32 \\(4,\\)"),
                               ("decay_mask", fake((n,), np.uint8), "decay_mask: expected uint8 \\(125,\\)"),
                               ("v_codes", fake((n,), F32), "v_codes: expected uint8"),
                               ("maps", fake((2, 256), F32), "maps: expected float32 \\(4, 256\\)"),
                               ("m_codes", fake((n,), np.uint8, 8), "m_codes: must start 16-byte aligned"),
                               ("params", fake((n,), F32, 4), "params: must start 16-byte aligned")):
        with pytest.raises(ValueError, match=message):
            ops.adamw8bit_update_bf16(**(arrays | {name: bad}), opt=AdamWConfig())
    from llama.optim import DYNAMIC_SIGNED, DYNAMIC_UNSIGNED, MIDPOINTS
    maps = ops.quantization_maps()
    for row, levels in ((0, DYNAMIC_SIGNED), (2, DYNAMIC_UNSIGNED)):
        np.testing.assert_array_equal(maps[row, :levels.size], levels)
        finite = maps[row + 1][np.isfinite(maps[row + 1])]
        np.testing.assert_array_equal(finite, MIDPOINTS[id(levels)])
        # the kernel's search: how many midpoints lie at or below x, in 8 halvings of the 256 entries
        for x in np.concatenate([finite, np.nextafter(finite, -2), levels, np.float32([-1, 0, 1])]):
            count = 0
            for step in (128, 64, 32, 16, 8, 4, 2, 1):
                count += step if maps[row + 1][count + step - 1] <= x else 0
            assert count == np.searchsorted(finite, x, side="right")


def test_adamw_scalars():
    opt = AdamWConfig(beta1=0.9, beta2=0.95)
    scalars = ops.adamw_scalars(3, 6e-4, opt)
    assert scalars.dtype == np.float32 and scalars.shape == (ops.ADAMW_SCALARS,)
    np.testing.assert_array_equal(scalars, np.float32([6e-4, 1 - 0.9 ** 3, 1 - 0.95 ** 3]))


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1001])
def test_the_packed_decay_mask_holds_a_bit_per_weight(n):
    """Weight i's decay at bit i % 8 of byte i // 8, where the kernels read it (bit k of byte first / 8 in the
    8-wide paths), and the last byte's unused bits 0."""
    mask = (np.random.default_rng(n).random(n) < 0.6).astype(np.uint8)
    packed = ops.pack_decay_mask(mask)
    assert packed.dtype == np.uint8 and packed.shape == (ops.packed_mask_size(n),) == (-(-n // 8),)
    i = np.arange(n)
    np.testing.assert_array_equal((packed[i // 8] >> (i % 8)) & 1, mask)
    assert packed[-1] >> (n - 8 * (packed.size - 1)) == 0


def test_a_range_of_the_packed_decay_mask_starts_on_a_whole_byte():
    """The optimizer in the backward updates a group of weights [start, start + n) with its range of the mask."""
    mask = (np.random.default_rng(0).random(1001) < 0.6).astype(np.uint8)
    packed, device = ops.pack_decay_mask(mask), fake((126,), np.uint8)
    for start, n in ((16, 900), (992, 9), (0, 1001)):
        part = ops.decay_mask_range(device, start, n)
        first = part.ptr - device.ptr
        assert first == start // 8 and part.shape == (ops.packed_mask_size(n),)
        bits = np.unpackbits(packed[first:first + part.size], bitorder="little")
        np.testing.assert_array_equal(bits[:n], mask[start:start + n])
    with pytest.raises(ValueError, match="multiples of 8 weights, not at 12"):
        ops.decay_mask_range(device, 12, 10)


def test_the_adamw_launchers_take_the_packed_mask_at_any_address(monkeypatch):
    """n % 8 weights in the last byte; the mask read a byte at a time, so it need not be aligned."""
    launches = []
    monkeypatch.setattr(importlib.import_module("llama.ops.adamw"), "kernel", lambda module, name, signature: (
        lambda grid, block, *args: launches.append((name, args))))
    n, mask = 1001, fake((126,), np.uint8, 1)
    common = dict(params=fake((n,), F32), grads=fake((n,), F32), decay_mask=mask, norm_squared=fake((1,), F32))
    ops.adamw_update(**common, m=fake((n,), F32), v=fake((n,), F32), step=1, lr=1e-3, opt=AdamWConfig())
    bf16 = dict(common, params_bf16=fake((n,)), scalars=fake((ops.ADAMW_SCALARS,), F32))
    ops.adamw_update_bf16(**bf16, m=fake((n,), F32), v=fake((n,), F32), opt=AdamWConfig())
    ops.adamw8bit_update_bf16(**bf16, m_codes=fake((n,), np.uint8), m_scales=fake((4,), F32),
                              v_codes=fake((n,), np.uint8), v_scales=fake((4,), F32), maps=fake((4, 256), F32),
                              opt=AdamWConfig())
    assert [name for name, _ in launches] == ["adamw_update", "adamw_update_bf16", "adamw8bit_update_bf16"]
    assert all(mask.ptr in args and n in args for _, args in launches)
    with pytest.raises(ValueError, match=r"decay_mask: expected uint8 \(126,\), got uint8 \(125,\)"):
        ops.adamw_update(**(common | {"decay_mask": fake((125,), np.uint8)}), m=fake((n,), F32), v=fake((n,), F32),
                         step=1, lr=1e-3, opt=AdamWConfig())


@pytest.mark.parametrize("N, vocab", [(1, 5), (40, 3), (1000, 50), (4096, 2), (5000, 30000)])
def test_token_segments(N, vocab):
    rng = np.random.default_rng(N)
    tokens = rng.integers(0, vocab, N)
    tokens[: N // 3] = tokens[0]
    order, segments = ops.token_segments(tokens.reshape(1, N))
    assert order.dtype == segments.dtype == np.int32 and order.shape == (N,) and segments.shape == (N, 4)
    assert np.array_equal(order, np.argsort(tokens, kind="stable"))
    used = segments[segments[:, 1] > segments[:, 0]]
    assert not segments[len(used):].any()  # padding: zeros, after the segments
    covered = []
    for group_begin, group_end, token, index in used:
        begin = group_begin + index * EMBEDDING_SEGMENT
        rows = order[begin:min(group_end, begin + EMBEDDING_SEGMENT)]
        assert len(rows) and (tokens[rows] == token).all()
        covered.extend(rows)
    assert sorted(covered) == list(range(N))  # each position in exactly one segment
    counts = -(-(used[:, 1] - used[:, 0]) // EMBEDDING_SEGMENT)
    assert (np.diff(counts) <= 0).all()  # tokens with several segments first, most first
    first = np.flatnonzero(used[:, 3] == 0)
    assert (used[first + counts[first] - 1, 3] == counts[first] - 1).all()  # a token's segments adjacent, in order
    assert (counts > 1).sum() <= embedding_partial_rows(N)  # room for their partial rows and counters


@pytest.mark.parametrize("M, N, K", [(768, 768, 16384), (1280, 768, 16384), (4096, 768, 16384), (128256, 768, 16384),
                                     (1000, 8, 16384), (200, 136, 1000), (136, 1000, 768)])
def test_wgmma3_splits(M, N, K):
    """Version 3's split-K count: only weight gradients into fp32 split, every split holds k-blocks, a
    few output tiles over a long K split, a GPU full of tiles does not."""
    problem = GemmProblem("tn", 1, M, N, K, 0, M, 0, 0, N, 0, 0, 0, "acc_f32", 1.0)
    k_blocks, tiles = math.ceil(K / 64), math.ceil(M / 128) * math.ceil(N / 128)
    for sms in (114, 132):
        splits = splitk_splits3(problem, sms)
        assert 1 <= splits <= k_blocks and math.ceil(k_blocks / math.ceil(k_blocks / splits)) == splits
        if tiles * 4 <= sms and k_blocks >= 64:
            assert splits > 1
        if tiles >= 8 * sms:
            assert splits == 1
        for other in (dict(layout="nt"), dict(layout="nn"), dict(batch=2), dict(mode="bf16")):
            assert splitk_splits3(replace(problem, **other), sms) == 1


@pytest.mark.parametrize("M, N, K, version", [
    (16384, 1280, 768, "wgmma5"), (16384, 8192, 2048, "wgmma5"), (768, 768, 16384, "wgmma5"),  # short K, few tiles
    (4096, 768, 16384, "wgmma5"), (16384, 768, 4096, "wgmma6"), (16384, 14336, 4096, "wgmma6"),  # 8B down dX
    (16384, 16384, 2048, "wgmma6"), (16384, 128256, 768, "wgmma6"), (16384, 2048, 128256, "wgmma6"),  # wide, long K
    (8192, 8192, 8192, "wgmma6"), (128256, 2048, 16384, "wgmma6")])
def test_the_hopper_gemm_chooser(M, N, K, version):
    """Production on Hopper: the ping-pong version 5 for few output tiles and for short K into outputs up to
    8192 wide, the cooperative 128x256 version 6 for long K and wide outputs; version 1 before Hopper."""
    from llama.run.plan import GemmChooser
    assert GemmChooser(hopper=True)(M, N, K) == version
    assert GemmChooser(hopper=False)(M, N, K) == "mma"
    assert GemmChooser(hopper=True, dynamic=True)(M, N, K) == {"wgmma5": "wgmma8", "wgmma6": "wgmma7"}[version]
    assert GemmChooser(hopper=False, dynamic=True)(M, N, K) == "mma"
    assert GemmChooser(hopper=True, fp8=True, dynamic=True)(M, N, K) == "wgmma6"  # FP8 has no dynamic twin


COUNTER = fake((1,), np.uint32, 256)  # the tile counter the launches below are given


def wgmma_launch(monkeypatch, version, M, N, K):
    """The one kernel launch of ops.gemm (nt, bf16 out) on `version`, recorded instead of run on 132 multiprocessors:
    (name, signature, grid, args, shared)."""
    launches = []
    monkeypatch.setattr(importlib.import_module("llama.ops.gemm"), "multiprocessors", lambda: 132)  # ops.gemm's module
    monkeypatch.setattr(gemm_wgmma, "multiprocessors", lambda: 132)
    monkeypatch.setattr(gemm_wgmma, "operand_maps", lambda p, bn: (b"", b""))
    monkeypatch.setattr(gemm_wgmma, "device_maps", lambda maps: fake((256,), np.uint8))
    monkeypatch.setattr(gemm_wgmma, "tile_counter", lambda: COUNTER)
    monkeypatch.setattr(gemm_wgmma, "kernel", lambda module, name, signature, directory: (
        lambda grid, block, *args, shared: launches.append((name, signature, grid, args, shared))))
    ops.gemm(fake((M, N)), fake((M, K)), fake((N, K)), trans_b=True, version=version)
    (launch,) = launches
    return launch


@pytest.mark.parametrize("dynamic, static", [("wgmma7", "wgmma6"), ("wgmma8", "wgmma5")])
@pytest.mark.parametrize("M, N", [(1000, 136), (16384, 2048)])  # 128 x 128 tiles; version 7 also 128 x 256
def test_dynamic_versions_launch_their_static_twin_with_a_counter(monkeypatch, dynamic, static, M, N):
    """Versions 7 and 8 launch version 6's and 5's kernel (the same tiles, grid and arguments) with the tile
    counter after c where the static entries take null, and the claimed units' ring beside their shared memory,
    within the 227 KB an H100 or H200 block may have."""
    name, signature, grid, args, shared = wgmma_launch(monkeypatch, dynamic, M, N, 768)
    static_name, static_signature, static_grid, static_args, static_shared = wgmma_launch(monkeypatch, static, M, N,
                                                                                          768)
    assert name == static_name.replace(static, dynamic) and signature == static_signature and grid == static_grid
    assert len(signature) == len(args) and args[2] == COUNTER.ptr and static_args[2] == 0
    assert args[:2] + args[3:] == static_args[:2] + static_args[3:]
    assert shared == static_shared + UNIT_RING_BYTES <= 227 * 1024
