"""The GPU models' wiring without a GPU, on tests/launch_recorder.py's stand-in: what each plan launches, that a
captured step launches what the eager step does, that the steps after the first allocate nothing, and that the
parts each plan composes are the ones it names."""

import numpy as np
import pytest

from llama.config import get_preset
from llama.model import build_model
from llama.optim import AdamWConfig
from llama.options import RunOptions
from llama.params import init_parameters
from llama.run.plan import evaluation_plan, make_plan
from tests.launch_recorder import RECORDED_RUNS, record_run, recording_gpu

CONFIG = get_preset("d6").replace(n_layers=2, vocab_size=512, max_seq_len=128)


def launched(events: list, since: int = 0) -> list[str]:
    """The kernels launched, by name, from event `since` on."""
    return [e[1] for e in events[since:] if e[0] == "launch"]


def batch(rng, B: int = 2, T: int = 64) -> tuple:
    return rng.integers(0, CONFIG.vocab_size, (B, T)), rng.integers(0, CONFIG.vocab_size, (B, T))


@pytest.mark.parametrize("name", sorted(RECORDED_RUNS))
def test_each_plan_launches_its_kernels_and_replays_its_graphs(name):
    spec = RECORDED_RUNS[name]
    events = record_run(spec)
    kernels = set(launched(events))
    assert any(k.startswith("gemm_wgmma6_fp8") for k in kernels) == (spec["dtype"] == "fp8")
    assert any(k.startswith("flash_attention") for k in kernels) == (spec["dtype"] != "fp32")
    assert any("document_bounds" in k for k in kernels) == bool(spec.get("sft"))
    assert any("adamw8bit" in k for k in kernels) == (spec.get("optimizer") == "adamw8bit")
    captures = sum(e[0] == "cuStreamBeginCapture_v2" for e in events)
    replays = sum(e[0] == "cuGraphLaunch" for e in events)
    if spec["dtype"] == "fp32":
        assert captures == replays == 0
    else:  # the step's graphs (one in the backward; else a micro-batch role each and the optimizer), the decoder's
        step_graphs = 1 if spec.get("in_backward") else min(spec.get("micro", 1), 2) + 1
        assert captures == step_graphs + 1
        assert replays == 2 * (spec.get("micro", 1) + 1 if not spec.get("in_backward") else 1) + 2  # and 2 decodes


@pytest.mark.parametrize("options", [dict(dtype="bf16"), dict(dtype="fp8", recompute="full"),
                                     dict(dtype="bf16", recompute="full", in_backward=True)])
def test_a_captured_step_launches_what_the_eager_step_does_and_allocates_nothing_after(options):
    rng = np.random.default_rng(1)
    micro = 1 if options.get("in_backward") else 2
    steps = [[batch(rng) for _ in range(micro)] for _ in range(3)]
    runs = {}
    for way in ("train_step", "eager_step"):
        with recording_gpu() as recording:
            model = build_model(CONFIG, make_plan(CONFIG, RunOptions("cuda", **options)), (2, 64),
                                init_parameters(CONFIG, 0))
            marks = []
            for step, batches in enumerate(steps, 1):
                marks.append((len(recording.events), len(recording.allocations)))
                getattr(model, way)(batches, 1e-3, step, AdamWConfig())
            marks.append((len(recording.events), len(recording.allocations)))
            runs[way] = recording.events, marks
            del model
    (captured, marks), (eager, eager_marks) = runs["train_step"], runs["eager_step"]
    # the first step of train_step runs eagerly, then captures: its launches twice, as the eager step's once
    first, eager_first = launched(captured[marks[0][0]:marks[1][0]]), launched(eager[eager_marks[0][0]:eager_marks[1][0]])
    assert first == eager_first * 2
    assert launched(captured[marks[1][0]:marks[3][0]]) == []  # steps 2 and 3 replay
    assert marks[1][1] == marks[3][1] and eager_marks[1][1] == eager_marks[3][1]  # nothing allocated after step 1


def test_the_parts_each_plan_composes():
    with recording_gpu():
        parts = {}
        for name, options in {"bf16": dict(dtype="bf16"), "fp8": dict(dtype="fp8"),
                              "in backward": dict(dtype="bf16", in_backward=True), "qlora": dict(lora=8, qlora=True)}.items():
            model = build_model(CONFIG, make_plan(CONFIG, RunOptions("cuda", **options)), (2, 64))
            parts[name] = type(model).__name__, type(model.linears).__name__, type(model.step).__name__
            assert model.block.linears is model.linears
            del model
    assert parts == {"bf16": ("GPUModelBF16", "BF16Linears", "CapturedStep"),
                     "fp8": ("GPUModelBF16", "FP8Linears", "CapturedStep"),
                     "in backward": ("GPUModelBF16", "BF16Linears", "InBackwardStep"),
                     "qlora": ("GPUModelBF16", "LoRALinears", "CapturedStep")}
    with pytest.raises(ValueError, match="the numpy reference runs a CPU plan"):
        build_model(CONFIG, make_plan(CONFIG, RunOptions("cpu")), None, comm=object())


@pytest.mark.parametrize("options", [dict(dtype="bf16"), dict(dtype="bf16", recompute="none"),
                                     dict(dtype="bf16", recompute="full", optimizer="adamw8bit"), dict(dtype="fp8"),
                                     dict(dtype="bf16", in_backward=True), dict(dtype="bf16", sft=True),
                                     dict(dtype="fp32"), dict(dtype="fp32", doc_mask="on"), dict(lora=16),
                                     dict(lora=8, qlora=True, sft=True), dict(lora=16, lora_targets="o,down")])
def test_the_memory_accounting_is_what_a_model_allocates(options):
    """llama/run/memory.py sums llama/model/shapes.py's descriptions and ZeRO's buffers; a model allocates from the
    same descriptions: the two agree to the byte (on one GPU, the model built, before any launch)."""
    from llama.run.memory import training_buffers
    for untied in (False, True):
        config = CONFIG.replace(tie_embeddings=not untied)
        with recording_gpu() as recording:
            plan = make_plan(config, RunOptions("cuda", bos_id=7, **options))
            model = build_model(config, plan, (3, 40))
            allocated = sum(end - start for start, end in recording.allocations)
            assert allocated == sum(training_buffers(plan, config, 3, 40).values()), (options, untied)
            del model


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_model_that_only_scores_holds_its_weights_alone_and_forwards_as_a_trained_one(dtype):
    """evaluation_plan's model has no gradients, moments or decay mask (an 8B model's weights fit where its training
    state would not); the memory accounting says so to the byte; its forward launches a training model's; it
    refuses a step."""
    from llama.run.memory import training_buffers
    tokens, targets = batch(np.random.default_rng(2))
    forwards = {}
    for scores_only in (True, False):
        with recording_gpu() as recording:
            plan = evaluation_plan(CONFIG, "cuda", dtype)
            if not scores_only:
                plan = make_plan(CONFIG, RunOptions("cuda", dtype, plan.recompute))
            model = build_model(CONFIG, plan, (3, 64))
            allocated = sum(end - start for start, end in recording.allocations)
            assert allocated == sum(training_buffers(plan, CONFIG, 3, 64).values()), scores_only
            start = len(recording.events)
            model.forward(tokens, targets)
            forwards[scores_only] = launched(recording.events, start), allocated
            if scores_only:
                assert model.zero.grads is None and model.zero.decay_mask is None and not hasattr(model.zero, "m")
                with pytest.raises(ValueError, match="only scores"):
                    model.train_step([(tokens, targets)], 1e-3, 1, AdamWConfig())
            del model
    assert forwards[True][0] == forwards[False][0]
    assert forwards[True][1] < forwards[False][1] - 3 * 4 * CONFIG.vocab_size * CONFIG.dim  # gradients and moments


def test_the_logits_of_a_position_of_each_row_take_a_gemm_for_each_chunk_the_logits_buffer_holds():
    """read_logits(positions) gathers the rows' final norms and runs one GEMM for as many rows as the logits buffer
    has (CLASSIFIER_CHUNK tokens), so more rows than that take two."""
    from llama.model.shapes import CLASSIFIER_CHUNK
    B = CLASSIFIER_CHUNK + 5
    with recording_gpu() as recording:
        model = build_model(CONFIG, evaluation_plan(CONFIG, "cuda", "bf16"), (B, 1))
        model.forward(np.zeros((B, 1), np.int32))
        start = len(recording.events)
        assert model.read_logits(0).shape == (B, CONFIG.vocab_size)
        assert sum(k.startswith("gemm") for k in launched(recording.events, start)) == 2
        assert sum(e[0] == "copy on device" for e in recording.events[start:]) == B
        del model


@pytest.mark.parametrize("options", [dict(dtype="bf16"), dict(dtype="fp8"), dict(dtype="bf16", in_backward=True)])
def test_a_model_and_its_decoder_are_freed_with_their_last_reference(options):
    """The parts hold no strong reference back to their model: no cycle keeps a model's device memory alive
    until the garbage collector runs."""
    import gc
    import weakref
    gc.disable()
    try:
        with recording_gpu():
            model = build_model(CONFIG, make_plan(CONFIG, RunOptions("cuda", **options)), (2, 64))
            from llama.model.generate import decoder_for
            decoder = decoder_for(model, model.plan, max_len=64)
            refs = weakref.ref(model), weakref.ref(decoder)
            del model, decoder
            assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()


@pytest.mark.parametrize("qlora", [False, True])
def test_a_fine_tune_through_adapters_trains_nothing_of_the_base(qlora):
    """With --lora the step launches no embedding backward and no GEMM into a base weight's gradient; the adapters'
    updates run beside each adapted GEMM (and QLoRA dequantizes before each use)."""
    rng = np.random.default_rng(2)
    with recording_gpu() as recording:
        model = build_model(CONFIG, make_plan(CONFIG, RunOptions("cuda", lora=8, qlora=qlora)), (2, 64))
        start = len(recording.events)
        model.train_step([batch(rng)], 1e-3, 1, AdamWConfig())
        kernels = launched(recording.events, start)
        del model
    assert "embedding_backward_bf16" not in kernels
    # the forward and dx of 4 GEMMs a layer, twice: the first step runs eagerly, then again while it is captured
    assert kernels.count("lora_add_bf16") == 2 * 2 * CONFIG.n_layers * 4
    assert ("nf4_dequantize_bf16" in kernels) == qlora


def test_the_lora_launchers_refuse_what_does_not_fit():
    from llama import ops
    from llama.runtime.cuda import BF16, DeviceArray
    fake = lambda shape, dtype=BF16: DeviceArray(0x10000, shape, dtype, None)  # noqa: E731
    with pytest.raises(ValueError, match="rows"):
        ops.lora_add_bf16(fake((4, 64)), fake((4, 16)), fake((64, 8)), 1.0, [32, 16], 8)
    with pytest.raises(ValueError, match="at most"):
        ops.lora_add_bf16(fake((4, 64)), fake((4, 256)), fake((64, 256)), 1.0, [64], 256)
    with pytest.raises(ValueError, match="xa: expected"):
        ops.lora_add_bf16(fake((4, 64)), fake((4, 8)), fake((64, 8)), 1.0, [32, 32], 8)
    with pytest.raises(ValueError, match="must sum to OC"):
        ops.lora_block_diagonal_bf16(fake((64, 16)), fake((64, 8)), [32, 16])
