"""scripts/bench_lora.py's parts that need no torch (the benchmark and the anchor's training run on the device): the
loss parity's inputs, which both sides train from, and its usage errors."""

import numpy as np
import pytest

from llama.config import get_preset
from llama.io.hf import load_hf_folder
from llama.io.peft import init_adapters, load_peft_adapter
from llama.params import LoraSpec
from llama.params import init_parameters
from scripts import bench_lora as bench


def test_the_parity_inputs_are_our_seeded_model_fresh_adapters_and_learnable_batches(tmp_path, capsys):
    assert bench.main(["--make-parity-inputs", str(tmp_path / "p"), "--model", "tiny", "--vocab", "200", "-b", "3",
                       "-t", "40", "--steps", "5", "--rank", "4", "--alpha", "8", "--seed", "2"]) == 0
    config = get_preset("tiny").replace(vocab_size=200)
    loaded_config, params = load_hf_folder(tmp_path / "p" / "base")
    assert loaded_config.vocab_size == 200 and np.array_equal(params, init_parameters(config, seed=2))
    spec, adapters = load_peft_adapter(tmp_path / "p" / "adapter", config)
    assert (spec.rank, spec.alpha, spec.dropout, spec.targets) == (4, 8.0, 0.0, LoraSpec(4, 8.0).targets)
    fresh = init_adapters(config, spec, seed=2)
    assert all(np.array_equal(adapters[n][0], fresh[n][0]) and not adapters[n][1].any() for n in fresh)
    batches = np.load(tmp_path / "p" / "batches.npy")
    assert batches.dtype == np.int32 and batches.shape == (5, 3, 41) and 0 <= batches.min() and batches.max() < 200
    for row in batches.reshape(-1, 41):  # a motif of 2..32 tokens, repeated
        period = next(p for p in range(2, 33) if np.array_equal(row[p:], row[:-p]))
        assert period <= 32
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [([], "give --hf-folder"), (["--make-hf-folder"], "give --hf-folder"),
                                           (["--hf-folder", "nowhere"], "not an HF model folder"),
                                           (["--loss-parity", "nowhere"], "holds no batches.npy"),
                                           (["--hf-folder", "x", "-b", "0"], "at least 1")])
def test_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("qlora", [False, True])
def test_the_breakdown_times_the_adapters_and_the_nf4_base(qlora, capsys):
    """--breakdown's step (scripts/bench_step.py kernel_breakdown, on the launch recorder's stand-in for the GPU):
    the adapters' launchers and the NF4 dequantization are timed beside the GEMMs, and printed largest first."""
    from llama.model import build_model
    from llama.optim import AdamWConfig
    from llama.options import RunOptions
    from llama.run.plan import make_plan
    from scripts.bench_step import kernel_breakdown
    from tests.launch_recorder import recording_gpu
    config = get_preset("d6").replace(n_layers=2, vocab_size=512, max_seq_len=128)
    tokens = np.random.default_rng(0).integers(0, 512, (2, 65)).astype(np.int32)
    with recording_gpu():
        model = build_model(config, make_plan(config, RunOptions("cuda", "bf16", recompute="full", lora=8,
                                                                 qlora=qlora)), (2, 64))
        totals = kernel_breakdown(model, [(tokens[:, :-1], tokens[:, 1:])], AdamWConfig()).totals()
        del model
    adapters = {"lora_add_bf16", "lora_block_diagonal_bf16", "lora_take_blocks_f32"}
    assert adapters <= set(totals) and ("nf4_dequantize_bf16" in totals) == qlora
    bench.print_breakdown("ours-qlora", {"gemm fwd (nt)": 2.0, "lora_add_bf16": 3.5}, 4.0)
    lines = capsys.readouterr().out.splitlines()
    assert "of 5.5 ms timed around launches; a replayed step 4.0 ms" in lines[0]
    assert lines[1].split() == ["lora_add_bf16", "3.50"] and lines[2].split()[-1] == "2.00"
