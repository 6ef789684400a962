"""GB/s of the memory-bound bf16 kernels at the d12 shapes, against the device's copy bandwidth.

First a large device-to-device copy (cuMemcpyDtoDAsync, counting bytes read + written) measures the
bandwidth to compare with. Then, for each kernel: the bytes it must move (each input read once, each
output written once; scratch traffic not counted), its median time (CUDA events around back-to-back
launches, after warm-up), its GB/s, and that as a fraction of the copy bandwidth (issue 10's target:
at least 85%). One table at the end.

    python3 scripts/bench_kernels.py [--tokens 16384] [--dim 768] [--ffn 2048] [--vocab 128256]
                                    [--chunk 4096] [--params 272.5e6] [--repeats 30]
"""

import argparse

import numpy as np

from llama import ops
from llama.runtime.cuda import BF16, empty, runtime, time_ms, to_device, zeros
from llama.optim import QUANT_BLOCK, AdamWConfig


def copy_bandwidth(repeats: int, nbytes: int = 1 << 30) -> float:
    """GB/s of a device-to-device copy of nbytes, counting the bytes read and written."""
    src, dst = zeros(nbytes, np.uint8), empty(nbytes, np.uint8)
    drv = runtime().drv
    ms = time_ms(lambda: drv.memcpy_dtod_async(dst.ptr, src.ptr, nbytes), repeats=repeats, inner=5)
    return 2 * nbytes / ms / 1e6


def bf16_normal(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32).astype(BF16)


# Each group allocates its own buffers and returns its kernels as (name, bytes it must move, fn).


def embedding_cases(args, rng) -> list:
    N, C, V = args.tokens, args.dim, args.vocab
    wte, out = to_device(bf16_normal(rng, V, C)), empty((N, C), BF16)
    tokens_d = to_device(rng.integers(0, V, N).astype(np.int32))
    cases = [("embedding_forward_bf16", 2 * N * C * 2 + N * 4, lambda: ops.embedding_forward_bf16(out, tokens_d, wte))]
    # uniform tokens: almost all distinct; Zipf's law: a few tokens own many positions, as in text
    for label, tokens in (("uniform", rng.integers(0, V, N)), ("zipf 1.1", np.minimum(rng.zipf(1.1, N), V) - 1)):
        order, segments = ops.token_segments(tokens)
        unique = len(np.unique(tokens))
        buffers = (zeros((V, C)), to_device(bf16_normal(rng, N, C)), to_device(order), to_device(segments),
                   zeros(ops.embedding_bf16_scratch_size(N, C)))
        cases.append((f"embedding_backward_bf16 ({label}, {unique} tokens)", N * C * 2 + unique * C * 4 * 2 + N * 20,
                      lambda buffers=buffers: ops.embedding_backward_bf16(*buffers)))
    return cases


def rmsnorm_cases(args, rng) -> list:
    N, C = args.tokens, args.dim
    x, branch, h, ln = (to_device(bf16_normal(rng, N, C)) for _ in range(4))
    weight, rstd, dweight = to_device(bf16_normal(rng, C)), empty(N), zeros(C)
    scratch = zeros(ops.rmsnorm_bf16_scratch_size(C))
    ops.rmsnorm_residual_forward_bf16(h, ln, rstd, x, branch, weight, 1e-5)  # a real h and rstd for the backward
    dresidual, dln = x, branch
    return [("rmsnorm_residual_forward_bf16", 4 * N * C * 2 + N * 4,
             lambda: ops.rmsnorm_residual_forward_bf16(h, ln, rstd, x, branch, weight, 1e-5)),
            ("rmsnorm_backward_bf16", 4 * N * C * 2 + N * 4,
             lambda: ops.rmsnorm_backward_bf16(dresidual, dweight, scratch, dln, h, weight, rstd))]


def swiglu_cases(args, rng) -> list:
    N, F = args.tokens, args.ffn
    gate_up, out, dout, dgate_up = (to_device(bf16_normal(rng, N, k * F)) for k in (2, 1, 1, 2))
    return [("swiglu_forward_bf16", 3 * N * F * 2, lambda: ops.swiglu_forward_bf16(out, gate_up)),
            ("swiglu_backward_bf16", 5 * N * F * 2, lambda: ops.swiglu_backward_bf16(dgate_up, dout, gate_up))]


def classifier_cases(args, rng) -> list:
    n, V, N = args.chunk, args.vocab, args.tokens
    logits = to_device(bf16_normal(rng, n, V))
    losses, targets, total = empty(n), to_device(rng.integers(0, V, n).astype(np.int32)), zeros(1)
    return [(f"fused_classifier_bf16 ({n} x {V})", 2 * n * V * 2 + n * 8,
             lambda: ops.fused_classifier_bf16(logits, losses, targets, 1.0 / N)),
            (f"loss_accumulate_bf16 ({n}, launch-bound)", n * 4, lambda: ops.loss_accumulate_bf16(total, losses, 1.0 / N))]


def optimizer_cases(args, rng) -> list:
    P = int(args.params)
    grads = to_device(rng.standard_normal(P, dtype=np.float32) * 1e-3)
    norm_squared, norm_scratch = empty(1), zeros(ops.NORM_BLOCKS + 1, np.float64)
    ops.global_norm_squared_bf16(norm_squared, norm_scratch, grads)
    params, m, v = to_device(rng.standard_normal(P, dtype=np.float32) * 0.02), zeros(P), zeros(P)
    params_bf16, mask = empty(P, BF16), to_device(ops.pack_decay_mask((rng.random(P) < 0.9).astype(np.uint8)))
    opt = AdamWConfig()
    scalars = to_device(ops.adamw_scalars(1, 3e-4, opt))
    # 8-bit moments (m codes, m scales, v codes, v scales): random codes of blocks of QUANT_BLOCK values
    blocks_n = -(-P // QUANT_BLOCK)
    moments = [to_device(rng.integers(0, 255, P, dtype=np.uint8)), to_device(rng.random(blocks_n, dtype=np.float32)),
               to_device(rng.integers(0, 255, P, dtype=np.uint8)), to_device(rng.random(blocks_n, dtype=np.float32))]
    maps = to_device(ops.quantization_maps())
    return [(f"global_norm_squared_bf16 ({P / 1e6:.1f}M)", P * 4,
             lambda: ops.global_norm_squared_bf16(norm_squared, norm_scratch, grads)),
            (f"adamw_update_bf16 ({P / 1e6:.1f}M)", P * (4 * 4 + 3 * 4 + 2) + mask.nbytes,
             lambda: ops.adamw_update_bf16(params, params_bf16, grads, m, v, mask, norm_squared, scalars, opt)),
            (f"adamw8bit_update_bf16 ({P / 1e6:.1f}M)",
             P * (4 + 4 + 1 + 1 + 4 + 2 + 1 + 1) + mask.nbytes + blocks_n * 16,
             lambda: ops.adamw8bit_update_bf16(params, params_bf16, grads, *moments, mask, norm_squared, scalars, maps,
                                               opt))]


def nf4_cases(args, rng) -> list:
    """--qlora's base: 8B's w1 (14336 x 4096) dequantized into bf16 (kernels/nf4.cu's floor: 2.516 bytes a weight),
    and quantized from bf16 (its three launches: codes and absmaxes, their mean, their codes)."""
    shape = (14336, 4096)
    n, sizes = shape[0] * shape[1], ops.nf4_sizes(shape)
    weights, tables = to_device(bf16_normal(rng, *shape)), to_device(ops.nf4_tables())
    codes, absmax = empty(sizes["codes"], np.uint8), empty(sizes["absmax"])
    absmax_codes = empty(sizes["absmax"], np.uint8)
    absmax_scales, offset, out = empty(sizes["absmax_scales"]), empty(1), empty(shape, BF16)
    state = dict(codes=codes, absmax_codes=absmax_codes, absmax_scales=absmax_scales, offset=offset, tables=tables)
    ops.nf4_quantize(absmax=absmax, weights=weights, **state)
    state_bytes = codes.nbytes + absmax_codes.nbytes + absmax_scales.nbytes + 4
    return [("nf4_dequantize_bf16 (14336 x 4096)", state_bytes + out.nbytes,
             lambda: ops.nf4_dequantize_bf16(out, **state)),
            ("nf4_quantize bf16 (14336 x 4096)", weights.nbytes + state_bytes + 3 * absmax.nbytes,
             lambda: ops.nf4_quantize(absmax=absmax, weights=weights, **state))]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384, help="N = B * T")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--chunk", type=int, default=4096, help="tokens per classifier chunk")
    parser.add_argument("--params", type=float, default=272.5e6)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()

    copy = copy_bandwidth(args.repeats)
    print(f"{runtime().name}: device-to-device copy {copy:.0f} GB/s (read + write)", flush=True)
    rows, rng = [], np.random.default_rng(0)
    for group in (embedding_cases, rmsnorm_cases, swiglu_cases, classifier_cases, optimizer_cases, nf4_cases):
        for name, nbytes, fn in group(args, rng):
            ms = time_ms(fn, repeats=args.repeats, inner=10)
            rows.append((name, nbytes, ms, nbytes / ms / 1e6))
            print(f"  {name}: {ms * 1e3:.1f} us", flush=True)
    print(f"\n{'kernel':<50s} {'MB':>9s} {'us':>9s} {'GB/s':>7s} {'of copy':>8s}")
    for name, nbytes, ms, gbps in rows:
        print(f"{name:<50s} {nbytes / 1e6:9.1f} {ms * 1e3:9.1f} {gbps:7.0f} {gbps / copy:8.0%}")
    print(f"(copy bandwidth {copy:.0f} GB/s; target >= 85% for the memory-bound kernels)")


if __name__ == "__main__":
    main()
