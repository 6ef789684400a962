"""LoRA on the GPU: kernels/lora.cu's three kernels against numpy in float64 (outputs poisoned first, sizes that are
not multiples of the tiles), and the bf16 model with adapters (llama/model/lora_linears.py, frozen_base.py)
against the float64 reference with the same adapters: the loss and the adapters' gradients of a step, the base
untouched, runs bit-identical, a captured step equal to an eager one, QLoRA's base the NF4 twin's."""

import numpy as np
import pytest

from llama.config import get_preset
from llama.model.reference import ReferenceModel
from llama.optim import AdamWConfig
from llama.options import RunOptions
from llama.run.plan import cpu_plan, make_plan
from tests.gpu_helpers import ERRORS, bf16_round, check, dev, dev_bf16, poisoned
from tests.gradcheck import rel_error

pytestmark = pytest.mark.gpu

CONFIG = get_preset("tiny").replace(dim=256, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=512, multiple_of=64,
                                    max_seq_len=96)


def segments_of(rows: list[int]) -> np.ndarray:
    return np.repeat(np.arange(len(rows)), rows)


@pytest.mark.parametrize("N, rows, r, rope", [(37, [64], 8, False), (100, [256, 128, 128], 16, True),
                                              (75, [300, 300], 24, False), (33, [96, 32, 32], 8, True)])
def test_lora_add_is_the_twin(N, rows, r, rope):
    """out += scale * xa[seg(o)] B^T, RoPE'd on the first columns like the QKV projection's output."""
    from llama import ops
    from llama.model.base import rope_cos_sin
    rng = np.random.default_rng(N)
    OC, m = sum(rows), len(rows)
    out0, xa, b = rng.standard_normal((N, OC)), rng.standard_normal((N, m * r)), rng.standard_normal((OC, r))
    out0, xa, b = bf16_round(out0), bf16_round(xa), bf16_round(b)
    delta = np.einsum("nok,ok->no", xa.reshape(N, m, r)[:, segments_of(rows)], b) * 0.5
    rope_arg = None
    if rope:  # the stack's first two targets are q and k of head dim 32: their columns rotate, as the GEMM's output
        D = 32
        cos, sin = rope_cos_sin(CONFIG.replace(dim=4 * D, n_heads=4), N)
        rotated = rows[0] + rows[1]
        pairs = delta[:, :rotated].reshape(N, -1, 2)
        c, s_ = np.tile(cos, (1, rotated // D)), np.tile(sin, (1, rotated // D))
        rotated_delta = np.stack([pairs[..., 0] * c - pairs[..., 1] * s_, pairs[..., 0] * s_ + pairs[..., 1] * c], -1)
        delta = np.concatenate([rotated_delta.reshape(N, rotated), delta[:, rotated:]], 1)
        rope_arg = (dev(cos), dev(sin), N, rotated)
    out = dev_bf16(out0)
    ops.lora_add_bf16(out, dev_bf16(xa), dev_bf16(b), 0.5, rows, r, rope=rope_arg)
    check(f"lora_add_bf16 {N}x{OC} r{r}", out, out0 + delta, tol=1e-2)
    a = bf16_round(rng.standard_normal((m * r, OC)))  # the transposed read: dx += dxa A
    out = dev_bf16(out0)
    ops.lora_add_bf16(out, dev_bf16(xa), dev_bf16(a), 1.0, [OC], m * r, transposed=True)
    check(f"lora_add_bf16 transposed {N}x{OC} k{m * r}", out, out0 + xa @ a, tol=1e-2)


@pytest.mark.parametrize("rows, r", [([64, 32, 32], 8), ([200, 200], 16), ([40], 24)])
def test_block_diagonal_and_taking_the_blocks(rows, r):
    from llama import ops
    rng = np.random.default_rng(r)
    OC, m = sum(rows), len(rows)
    b = bf16_round(rng.standard_normal((OC, r)))
    from llama.runtime.cuda import BF16
    spread = poisoned((OC, m * r), BF16)
    ops.lora_block_diagonal_bf16(spread, dev_bf16(b), rows)
    expected = np.zeros((OC, m * r))
    for o, j in enumerate(segments_of(rows)):
        expected[o, j * r:(j + 1) * r] = b[o]
    check("lora_block_diagonal_bf16", spread, expected, tol=1e-12)  # a copy: exact
    c, db0 = rng.standard_normal((OC, m * r)), rng.standard_normal((OC, r))
    db = dev(db0)
    ops.lora_take_blocks_f32(db, dev(c), rows)
    taken = np.stack([c[o, j * r:(j + 1) * r] for o, j in enumerate(segments_of(rows))])
    check("lora_take_blocks_f32", db, db0 + taken.astype(np.float32), tol=1e-7)


def lora_models(qlora: bool, recompute: str = "partial", B: int = 3, T: int = 80, seed: int = 5):
    """The GPU model with rank-8 adapters on every linear and the float64 reference with the same base (bf16
    values) and adapters (B drawn nonzero, so that every path carries a gradient)."""
    from llama.model import build_model
    from llama.params import init_parameters
    from llama.runtime.cuda import BF16
    params = init_parameters(CONFIG, seed).astype(BF16).astype(np.float32)
    options = dict(lora=8, lora_alpha=16.0, qlora=qlora)
    gpu = build_model(CONFIG, make_plan(CONFIG, RunOptions("cuda", "bf16", recompute=recompute, **options)), (B, T),
                      params, seed=seed)
    cpu = ReferenceModel(CONFIG, cpu_plan(**options), params=params.astype(np.float64), seed=seed, dtype=np.float64)
    adapters = cpu.get_params()
    adapters = adapters + np.random.default_rng(seed).standard_normal(adapters.shape) * 0.02 * (adapters == 0)
    adapters = adapters.astype(BF16).astype(np.float32)  # the values both read: the GPU's bf16 copy
    gpu.set_state(adapters)
    cpu.set_state(adapters.astype(np.float64))
    return gpu, cpu


def batch(seed, B=3, T=80):
    rng = np.random.default_rng(seed)
    return rng.integers(0, CONFIG.vocab_size, (B, T)), rng.integers(0, CONFIG.vocab_size, (B, T))


@pytest.mark.parametrize("qlora", [False, True])
@pytest.mark.parametrize("recompute", ["partial", "full"])
def test_one_step_of_the_adapters_is_the_reference_s(qlora, recompute):
    gpu, cpu = lora_models(qlora, recompute)
    tokens, targets = batch(1)
    cpu_loss = cpu.forward(tokens, targets)
    cpu.backward()
    gpu_loss = gpu.forward(tokens, targets, loss_scale=1.0)
    gpu.backward()
    assert abs(gpu_loss - cpu_loss) < 2e-2 * abs(cpu_loss)
    grads = gpu.zero.grads.download()[:gpu.trained.size]
    err = rel_error(grads, cpu.grads)
    ERRORS.append((f"lora adapters' gradients (qlora={qlora}, {recompute})", err))
    assert err < 3e-2


def test_the_base_stays_frozen_and_runs_are_bit_identical():
    a, _ = lora_models(qlora=True, seed=6)
    b, _ = lora_models(qlora=True, seed=6)
    before = {name: buffer.download().tobytes() for name, buffer in a.base.buffers.items() if name != "dequantized"}
    steps = [([batch(10 + s)], 1e-3, s + 1, AdamWConfig()) for s in range(3)]
    results = [a.train_step(*s) for s in steps]
    assert results == [b.eager_step(*s) for s in steps]  # captured (a, from step 2) against eager (b): the same bits
    assert results[-1][0] < results[0][0]
    after = {name: buffer.download().tobytes() for name, buffer in a.base.buffers.items() if name != "dequantized"}
    assert after == before
    for x, y in zip(a.get_optimizer_state(), b.get_optimizer_state()):
        assert np.array_equal(x, y)


def test_qlora_s_base_dequantizes_to_the_nf4_twin():
    from llama.twins import nf4
    gpu, _ = lora_models(qlora=True, seed=7)
    tensor = gpu.layout.wqkv(1)
    from llama.params import init_parameters
    from llama.runtime.cuda import BF16
    params = init_parameters(CONFIG, 7).astype(BF16).astype(np.float32)
    views = gpu.layout.views(params)
    expected = np.concatenate([nf4.dequantize(nf4.quantize(views[f"layers.1.attention.{w}.weight"]))
                               for w in ("wq", "wk", "wv")])
    got = gpu.weight(tensor).download().astype(np.float64)
    assert np.array_equal(got, expected.astype(BF16).astype(np.float64))
