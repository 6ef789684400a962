"""The training run: a Trainer sets it up from the command line's arguments (the plan of what runs
where, the data, the model, the resume), then takes the steps, evaluating, sampling and writing
checkpoints along the way. train_llama.py parses the arguments and runs it.

Every model takes its step the same way (llama/model/base.py: Model.train_step); the trainer adds
what a run needs around it: the learning-rate schedule, the data order, the logs and progress, the
checks that stop a diverged run before it overwrites a good checkpoint, and resume bit for bit.
"""

from __future__ import annotations

import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from .. import ops
from ..cache import cache_dir
from ..config import META_MODELS, LlamaConfig, get_preset
from ..data.dataloader import DataLoader
from ..data.datasets import prepare_builtin_corpus, starter_pack_shards
from ..data.tokenizer import load_tokenizer
from ..eval.items import TaskError
from ..eval.runner import Evaluation, accuracy_over_ranks
from ..eval.scoring import metrics, suite_score
from ..eval.tasks import SUITE, load_tasks
from ..io.background import SLOW, BackgroundJob
from ..io.checkpoint import (CheckpointError, best_checkpoint, checkpoint_ranges, load_state_into, lora_state,
                             newest_usable, read_data, save_checkpoint, snapshot_moments, trained_layout)
from ..io.guard import SAVE, SKIP, STOP, CheckpointGuard, rms_of
from ..io.hf import hf_tokenizer_path, load_hf_folder, load_hf_to_device, read_hf_config
from ..io.lora_base import base_checkpoint, base_identity, base_init, describe_base, read_base
from ..io.read_ahead import ReadAhead
from ..io.run_dir import RunDir
from ..model import build_model
from ..model.base import counted_targets
from ..model.generate import decoder_for, generate
from ..model.sampling import Sampling
from ..optim import AdamWConfig, learning_rate
from ..options import RunOptions
from ..params import ParameterLayout, count_parameters, init_parameters
from ..runtime.cuda import runtime
from ..runtime.kernel_build import build, kernels_for
from ..runtime.machine import gpu_free, host_available, require
from ..runtime.progress import TrainingProgress, phase
from ..runtime.signals import GracefulStop
from .memory import sampling_buffers, training_buffers, what_would_fit
from .plan import Plan, choose_device, make_plan

DEVICE_DEFAULTS = {"cpu": {"model": "small", "batch_size": 4, "seq_len": 64, "lr": 3e-3, "steps": 100},
                   "cuda": {"model": "d12", "batch_size": 8, "seq_len": 1024, "lr": 6e-4, "steps": 200}}
CPU_STEP_FLOPS = 1e12  # a step above this takes about a minute or more on a CPU (d12 at -b 8 -t 1024: 4 TFLOP)
RESUME_SAME = ("seq_len", "tokens_per_step", "seed")  # what exact resume needs: B and the GPU count may change


class UserError(Exception):
    """A mistake in the command line or its inputs: reported in one line, no traceback."""


class TrainingDiverged(Exception):
    """The loss or gradient became NaN or infinite, or the weights failed the checkpoint check."""


def resolve_config(name: str) -> LlamaConfig:
    return LlamaConfig.load(name) if name.endswith(".json") else get_preset(name)


def resolve_data(args, tokenizer) -> tuple[str, str | None]:
    if args.train_data:
        return args.train_data, args.val_data
    starter_pack = starter_pack_shards()
    if all(p.exists() for p in starter_pack):
        print(f"data: the starter pack's tinyshakespeare ({starter_pack[0]})")
        return tuple(map(str, starter_pack))
    builtin = cache_dir() / "builtin"
    try:
        train, val = prepare_builtin_corpus(builtin, tokenizer)
    except OSError as e:
        raise UserError(f"cannot build the built-in corpus in {builtin}: {e.strerror or e}") from None
    print(f"data: the built-in corpus (this Python's standard library sources, {train}). For real text, run "
          "python3 scripts/download_starter_pack.py")
    return str(train), str(val)


def data_arguments(args: dict) -> str:
    """A run's data in the words of its command line (args: its arguments, as a checkpoint records them)."""
    given = " ".join(f"{flag} {args[key]}" for flag, key in (("-i", "train_data"), ("-j", "val_data")) if args.get(key))
    return given or "the default data (no -i)"


def matmul_flops_per_token(config: LlamaConfig, T: int) -> float:
    """Training FLOPs per token, llm.c's convention: 6 per matmul weight + causal attention."""
    layout = ParameterLayout(config)
    weights = sum(t.size for t in layout.tensors.values() if len(t.shape) == 2)
    if not config.tie_embeddings:
        weights -= config.vocab_size * config.dim  # the embedding lookup is not a matmul
    return 6 * weights + 6 * config.n_layers * config.dim * T


def check_memory(plan: Plan, config: LlamaConfig, B: int, T: int, gpus: int, free_gpu: int | None = None,
                 sampling: bool = False) -> str:
    """One line: what a run needs of its device's memory and what is available (free_gpu: the GPU's free bytes,
    None reads this one's; sampling: the run samples, on several GPUs from gathered weights), checked before
    anything large is allocated; NotEnoughMemory, naming what would fit, when it does not (llama/run/memory.py)."""
    needed = sum(training_buffers(plan, config, B, T, gpus).values())
    if sampling and plan.device == "cuda":
        needed += sum(sampling_buffers(config, gpus).values())
    available, where = ((host_available(), "host") if plan.device == "cpu" else
                        (gpu_free() if free_gpu is None else free_gpu, "GPU"))
    advice = what_would_fit(plan, config, B, T, gpus, available) if available is not None and needed > available else ""
    return "memory: " + require(needed, available, "the run", where, advice, lower_bound=plan.device == "cuda")


def mean_over_ranks(comm, *values: float) -> list[float]:
    """The mean over ranks of a few host numbers (the values themselves on one process)."""
    if comm is None:
        return list(values)
    return list(comm.host_reduce(values) / comm.world_size)


def find_resume_checkpoint(out: Path, read: bool = True) -> dict | None:
    """The newest usable checkpoint in out (read: with its data), after one line for each newer one that is not
    usable; None, said in the header, when out holds no complete checkpoint (--resume auto: train_llama.py refuses
    a plain --resume there before the run begins)."""
    found, skipped = newest_usable(out, read)
    for reason in skipped:
        print(f"warning: skipping an unusable checkpoint: {reason}", file=sys.stderr)
    if found is None and skipped:
        raise UserError(f"--resume: none of the {len(skipped)} checkpoints in {out} is usable; "
                        "start over with --overwrite")
    if found is None:
        print(f"--resume auto: {out} holds no complete checkpoint; starting a new run")
    return found


def step_line(step: int, steps: int, loss: float, lr: float, norm: float, dt: float, tokens: int,
              mfu: float | None) -> str:
    """llm.c's progress line, for logs that are not a terminal."""
    line = (f"step {step + 1:4d}/{steps} | loss {loss:.6f} | lr {lr:.2e} | norm {norm:.4f} | {dt * 1e3:.1f} ms | "
            f"{tokens / dt:,.0f} tok/s")
    return line + (f" | MFU {mfu:.1%}" if mfu is not None else "")


class Trainer:
    """One training run in run_dir; comm is the NCCL communicator of a multi-GPU run (None on one
    process). __init__ sets everything up (and restores a checkpoint with --resume); run() trains."""

    def __init__(self, args, run_dir: RunDir, comm=None):
        self.args, self.run_dir, self.out, self.comm = args, run_dir, run_dir.path, comm
        self.rank, self.world = (comm.rank, comm.world_size) if comm is not None else (0, 1)
        self._batch_geometry()
        hf_folder = args.init[3:] if args.init and args.init.startswith("hf:") else None
        self.tokenizer = load_tokenizer(args.tokenizer or (hf_folder and hf_tokenizer_path(hf_folder)), fetch=True)
        # weights go straight to the GPU; with --lora the base is read on the host and given to the model
        on_device = choose_device(args.device) != "cpu" and self.world == 1 and args.lora is None
        # a resume on one GPU streams its checkpoint's data into the model once built (_restore), and its files are
        # read into memory from now on, beside the plan, the kernels and the model's build
        resume = find_resume_checkpoint(self.out, read=not on_device) if args.resume else None
        read_ahead = ReadAhead(checkpoint_ranges(resume)) if resume is not None and on_device else None
        try:
            self._set_up(resume, hf_folder, on_device, read_ahead)
        finally:
            if read_ahead is not None:
                read_ahead.close()

    def _set_up(self, resume: dict | None, hf_folder: str | None, on_device: bool, read_ahead: ReadAhead | None):
        """__init__'s rest: the plan, kernels, data, model (restored from resume), guard, evaluation, writer."""
        args, comm = self.args, self.comm
        # --init's checkpoint (a full fine-tune's): the weights to start from, or with --lora the frozen base
        init = base_checkpoint(args.init) if args.init and hf_folder is None else None
        checkpoint = resume or init
        if args.lora is None:
            hf_folder = hf_folder if checkpoint is None else None  # a resume reads its checkpoint, not the folder
        # an HF folder's weights are read once the memory check passed, its config.json alone before
        self.config = self._model_config(checkpoint["config"] if checkpoint is not None else
                                         read_hf_config(hf_folder) if hf_folder else None)
        # every rank plans with the least free GPU memory among them: the same ZeRO stage, the same memory verdict
        free_gpu = int(comm.host_reduce([gpu_free()], "min")[0]) if comm is not None else None
        options = RunOptions.from_args(args, self.world, (self.B, self.T), self.tokenizer.bos_id)
        self.plan = make_plan(self.config, options, free_gpu)
        print(self.plan.summary())
        if resume is not None:
            self._check_same_adapters(resume)
        self.sample_every = args.sample_every
        if self.plan.device == "cuda" and self.plan.lora and self.sample_every:
            print("note: no samples during a fine-tune through adapters on the GPU (its base is frozen in bf16 or NF4, "
                  "no decoder reads it): export the run with --merge and generate from the export", file=sys.stderr)
            self.sample_every = 0
        if self.plan.device == "cuda":  # every kernel the plan launches, compiled now in parallel unless cached
            build(kernels_for(self.plan, runtime().code, decoder=bool(self.sample_every),
                              head_dim=self.config.head_dim))
        if self.plan.in_backward and self.grad_accum > 1:
            raise UserError(f"--optimizer-in-backward updates the weights in each backward, so a step is one micro-batch: "
                            f"--total-batch-size must be B*T*GPUs ({self.B * self.T * self.world}), not "
                            f"{self.tokens_per_step}")
        self.flops_per_step = matmul_flops_per_token(self.config, self.T) * self.tokens_per_step
        if self.plan.device == "cpu" and self.flops_per_step > CPU_STEP_FLOPS:
            print(f"note: this run computes {self.flops_per_step / 1e12:,.1f} TFLOP a step, minutes a step on a CPU: "
                  "its model and batch are sized for a GPU (the CPU default: -e {model} -b {batch_size} -t {seq_len})"
                  .format(**DEVICE_DEFAULTS["cpu"]), file=sys.stderr)
        print(check_memory(self.plan, self.config, self.B, self.T, self.world, free_gpu, bool(self.sample_every)))
        self._data()
        self.run_settings = {"batch_size": self.B, "seq_len": self.T, "tokens_per_step": self.tokens_per_step,
                             "seed": args.seed}
        if self.plan.lora is None:
            if init is not None and checkpoint is init:
                checkpoint = read_data(init)
            params = (checkpoint["params"] if checkpoint is not None else None if on_device
                      else self._load_hf(hf_folder) if hf_folder else self._initialize())
            self.adapters_state = {}
        else:
            params = self._lora_base(base_init(args.init), resume)
        self.model = build_model(self.config, self.plan, (self.B, self.T), params, args.seed, comm)
        if hf_folder and on_device:
            self._load_hf_to_device(hf_folder)
        self.sample_rng = np.random.default_rng(args.seed)
        # each checkpoint's weights are checked on this fixed batch before they are saved (io/guard.py)
        probe_loader = DataLoader(self.val_pattern or self.train_pattern, self.B, self.T, shuffle=False,
                                  vocab_size=self.config.vocab_size)
        self.probe_batch = self._read(probe_loader)
        self.start, self.log_bytes = 0, 0
        if resume is not None:
            resume = self._restore(resume, read_ahead)
        self.last_good = resume["path"] if resume is not None else None
        best = resume["state"].get("best_probe_loss") if resume is not None else None
        if self.rank == 0:  # rank 0 judges the weights (with --lora the adapters)
            self.guard = CheckpointGuard(rms_of(self.guarded(self.model.get_params() if self.plan.lora else params)),
                                         best)
        else:
            self.guard = None
        self.opt = AdamWConfig(weight_decay=args.weight_decay, grad_clip=args.grad_clip)
        self.peak_flops = self.plan.peak_flops * self.world if self.plan.peak_flops else None  # MFU per GPU
        self._announce("from checkpoint" if checkpoint is not None else f"from {args.init}" if hf_folder
                       else args.model or self.defaults["model"])
        # on several GPUs the decoder reads a snapshot of the weights gathered for each sample
        self.decoder = (decoder_for(self.model, self.plan, max_len=self.T) if self.sample_every and comm is None
                        else None)
        self.evaluations = self._evaluations()
        self.log = None  # main.log, open while run() trains
        self.writer = BackgroundJob("checkpoint writer")  # rank 0 writes checkpoints while training goes on
        self.snapshot = None  # on one GPU: the page-locked host copy of the state a checkpoint writes
        if on_device:  # its memory page-locked while training starts, ready for the first checkpoint
            self.model.reserve_state()

    # ---- setup

    def _batch_geometry(self) -> None:
        """The device's defaults, B, T, the tokens of a step over all GPUs and the accumulation."""
        args = self.args
        device = choose_device(args.device)
        if self.world > 1 and device != "cuda":
            raise UserError(f"{self.world} processes were started, but several processes need CUDA GPUs")
        self.defaults = DEVICE_DEFAULTS[device]
        self.B = args.batch_size or self.defaults["batch_size"]
        self.T = args.seq_len or self.defaults["seq_len"]
        self.tokens_per_step = args.total_batch_size or self.B * self.T * self.world
        if self.tokens_per_step % (self.B * self.T * self.world):
            raise UserError(f"--total-batch-size ({self.tokens_per_step}) must be a positive multiple of B*T*GPUs "
                            f"({self.B}*{self.T}*{self.world})")
        self.grad_accum = self.tokens_per_step // (self.B * self.T * self.world)
        self.lr = args.lr if args.lr is not None else self.defaults["lr"]

    def _model_config(self, loaded: LlamaConfig | None) -> LlamaConfig:
        """The config of the checkpoint or HF folder (loaded), or the preset's with the tokenizer's vocab;
        checked against both."""
        args, tokenizer = self.args, self.tokenizer
        if loaded is not None:
            config = loaded
            if args.model and resolve_config(args.model).replace(vocab_size=config.vocab_size) != config:
                raise UserError(f"the checkpoint's model config does not match --model {args.model}")
        else:
            name = args.model or self.defaults["model"]
            config = resolve_config(name)
            if name in META_MODELS and config.vocab_size != tokenizer.vocab_size:
                raise UserError(f"-e {name} is Meta's model, made for the Llama 3 tokenizer (vocab "
                                f"{config.vocab_size}), but the tokenizer here is {tokenizer.name} (vocab "
                                f"{tokenizer.vocab_size}); get it with python3 scripts/download_starter_pack.py, or "
                                "pass it with --tokenizer")
            config = config.replace(vocab_size=tokenizer.vocab_size)
        if config.vocab_size != tokenizer.vocab_size:
            raise UserError(f"the model's vocab ({config.vocab_size}) differs from the tokenizer's "
                            f"({tokenizer.vocab_size}, {tokenizer.name}); pass the tokenizer the model was trained "
                            "with")
        if self.T > config.max_seq_len:
            raise UserError(f"--seq-len {self.T} exceeds the model's max_seq_len {config.max_seq_len}")
        return config

    def _initialize(self) -> np.ndarray:
        """Fresh parameters from the seed on the host: drawn on the GPU on several GPUs, by the numpy twin on
        the CPU (the same values; one GPU draws them in the model instead)."""
        layout = ParameterLayout(self.config)
        with phase("initializing the weights", total=layout.size, unit="param") as progress:
            if self.plan.device == "cpu":
                return init_parameters(self.config, self.args.seed, on_tensor=progress.update)
            return ops.init_parameters_on_gpu(layout, self.args.seed, on_values=progress.update)

    def _load_hf(self, folder: str) -> np.ndarray:
        """The weights of a Hugging Face folder, with their progress where reading them takes a while."""
        with phase(f"reading {folder}", total=count_parameters(self.config), unit="param") as progress:
            return load_hf_folder(folder, on_tensor=progress.update)[1]

    def _lora_base(self, init: str | None, resume: dict | None) -> np.ndarray | None:
        """--lora's frozen base: --init's HF folder or full fine-tune's checkpoint read on the host, or None (the model
        draws it from --seed); its identity goes into each checkpoint (self.adapters_state), and a resume whose
        adapters were trained on another base is refused."""
        config, params = self.config, None
        if init is not None:
            total = count_parameters(self.config) if init.startswith("hf:") else None
            with phase(f"reading {init.removeprefix('hf:')}", total=total, unit="param") as progress:
                config, params = read_base(init, progress.update)
        identity = base_identity(config, init, self.args.seed, params)
        if resume is not None and resume["state"]["base"]["digest"] != identity["digest"]:
            raise UserError(f"--resume: the checkpoint's adapters were trained on "
                            f"{describe_base(resume['state']['base'])}, this run's base is {describe_base(identity)}; "
                            "resume with the --init (and --seed) they were trained on")
        self.adapters_state = {"lora": lora_state(self.plan.lora), "qlora": self.plan.qlora, "base": identity}
        return params

    def _check_same_adapters(self, resume: dict) -> None:
        """A resume trains what its checkpoint trained: the whole model, or adapters of the same LoraSpec on the same
        kind of base (the base itself is checked once read, _lora_base)."""
        theirs, state = resume["lora"], resume["state"]
        if theirs is None and self.plan.lora is None:
            return
        if theirs is None:
            raise UserError("--resume: the checkpoint is a full fine-tune's; resume it without --lora, or start "
                            "adapters over with --overwrite")
        if (theirs, state.get("qlora", False)) != (self.plan.lora, self.plan.qlora):
            raise UserError(f"--resume: the checkpoint holds other adapters; resume with --lora {theirs.rank} "
                            f"--lora-alpha {theirs.alpha:g} --lora-targets {','.join(theirs.targets)}"
                            + " --qlora" * state.get("qlora", False))

    def _load_hf_to_device(self, folder: str) -> None:
        """The weights of a Hugging Face folder uploaded into the model (one GPU) while they are read."""
        with phase(f"reading {folder}", total=count_parameters(self.config), unit="param") as progress:
            self.model.set_weights_on_device(lambda master: load_hf_to_device(folder, master, progress.update))

    def _data(self) -> None:
        """The loaders and the step count. A loader batch is this rank's rows of one step (B * grad_accum
        rows of every B * grad_accum * world), so the data order is the same on any number of GPUs for
        the same tokens per step."""
        args, B, T, V = self.args, self.B, self.T, self.config.vocab_size
        self.train_pattern, self.val_pattern = resolve_data(args, self.tokenizer)
        self.train_loader = DataLoader(self.train_pattern, B * self.grad_accum, T, self.rank, self.world,
                                       seed=args.seed, vocab_size=V)
        self.val_loader = (DataLoader(self.val_pattern, B, T, self.rank, self.world, shuffle=False, vocab_size=V)
                           if self.val_pattern else None)
        if args.train_data:
            print("data: " + ", ".join(f"{what} {loader.describe()}" for what, loader in
                                       (("train", self.train_loader), ("val", self.val_loader)) if loader))
        if self.plan.sft:  # every shard's loss mask, before the run starts, and something in them to learn from
            for loader in filter(None, (self.train_loader, self.val_loader)):
                loader.check_masks()
            if not self.train_loader.counted_tokens():
                raise UserError(f"--sft: the loss masks of {self.train_pattern} count no token (conversations without "
                                "an assistant reply): nothing to learn from; prepare conversations with replies")
        elif self.train_loader.has_masks():
            print(f"note: {self.train_pattern} has loss masks (.mask.bin: chat data), which count only without --sft: "
                  "every token is trained on; pass --sft to train on the assistant's replies", file=sys.stderr)
        if self.plan.doc_mask and not self.train_loader.holds_token(self.tokenizer.bos_id):
            print(f"note: --doc-mask: the first shard of {self.train_pattern} holds no <|begin_of_text|> (id "
                  f"{self.tokenizer.bos_id}) to start a document, so every row attends as with --doc-mask off",
                  file=sys.stderr)
        self.upcoming = None  # the next step's (micro-batches, loss divisor), read while this step's were on the GPU
        if args.steps is not None and args.steps != -1:
            self.steps = args.steps
        elif args.epochs is not None or args.steps == -1:  # -x -1 is one epoch, as in llm.c
            self.steps = math.ceil((args.epochs or 1) * self.train_loader.batches_per_epoch)
        else:
            self.steps = self.defaults["steps"]

    def _restore(self, resume: dict, read_ahead: ReadAhead | None) -> dict:
        """The model, optimizer, data order and sampling state of a checkpoint (--resume); returns the checkpoint
        restored: on one GPU its data streams into the model, and when it proves unusable, the next older one."""
        self._check_same_run(resume["state"])
        if resume["params"] is None:
            resume = self._stream_into_model(resume, read_ahead)
        else:  # the model was built from its weights, or with --lora from the base: the adapters are its weights
            self.model.set_state(resume["params"] if self.plan.lora else None, resume["adam_m"], resume["adam_v"])
        state = resume["state"]
        try:
            self.train_loader.load_state_dict(state["loader"])
        except ValueError as e:
            raise UserError(f"--resume: {e}; the run trained on {data_arguments(state.get('args', {}))}: pass the "
                            "same data") from None
        self.sample_rng.bit_generator.state = state["sample_rng"]
        self.model.group_norms_squared = state.get("group_norms_squared")
        self.start, self.log_bytes = state["step"], state.get("log_bytes")
        print(f"resuming from {resume['path']} (step {self.start})")
        if self.start >= self.steps:
            print(f"note: the checkpoint is at step {self.start}, the run has {self.steps} steps: nothing to train "
                  "(ask for more with -x)", file=sys.stderr)
        return resume

    def _check_same_run(self, state: dict) -> None:
        for key in RESUME_SAME:
            if state["run"][key] != self.run_settings[key]:
                raise UserError(f"--resume: the checkpoint was made with {key} {state['run'][key]}, "
                                f"this run asks for {self.run_settings[key]}")

    def _stream_into_model(self, resume: dict, read_ahead: ReadAhead | None) -> dict:
        """The checkpoint's data streamed into the model (one GPU); when it proves unusable (weights that are not
        finite, a file cut short since it was checked), a warning and the next older usable one, read on the host."""
        try:
            load_state_into(self.model, resume, read_ahead)
            return resume
        except CheckpointError as e:
            print(f"warning: skipping an unusable checkpoint: {e}", file=sys.stderr)
        older, skipped = newest_usable(self.out, before=resume["path"])
        for reason in skipped:
            print(f"warning: skipping an unusable checkpoint: {reason}", file=sys.stderr)
        if older is None or older["config"] != self.config:
            raise UserError(f"--resume: no checkpoint older than {resume['path']} is usable with its model config; "
                            "start over with --overwrite")
        self._check_same_run(older["state"])
        self.model.set_state(older["params"], older["adam_m"], older["adam_v"])
        return older

    def _evaluations(self) -> list[Evaluation]:
        """Each --eval task tokenized into this rank's passes of the model's B rows of T (none without --eval)."""
        args = self.args
        if not args.eval:
            return []
        try:
            tasks = load_tasks(args.eval, None, args.eval_source, args.eval_limit, ("--eval", "--eval-source"))
            evaluations = []
            for task in tasks:
                with self._reported(f"--eval: tokenizing {task.name}"):
                    evaluations.append(Evaluation(task, self.tokenizer, self.B, self.T, self.rank, self.world))
            return evaluations
        except (TaskError, ValueError) as e:
            raise UserError(f"--eval: {e}") from None

    def _reported(self, description: str, **kwargs):
        """A phase (llama/progress.py) that rank 0 reports; nothing on the other ranks."""
        return phase(description, **kwargs) if self.rank == 0 else nullcontext()

    def _announce(self, model_name: str) -> None:
        gpus = f" x {self.world} GPUs (ZeRO-{self.plan.zero} over NCCL)" if self.world > 1 else ""
        adapters = (f" (frozen), {trained_layout(self.config, self.plan.lora).size / 1e6:.3f}M in adapters"
                    if self.plan.lora else "")
        print(f"device {self.plan.device}{gpus} | model {model_name}: "
              f"{ParameterLayout(self.config).size / 1e6:.2f}M params{adapters}, vocab {self.config.vocab_size} | "
              f"B={self.B} T={self.T} grad_accum={self.grad_accum} ({self.tokens_per_step} tokens/step) | "
              f"{self.steps} steps, {self.train_loader.batches_per_epoch} steps/epoch")

    # ---- what a run does

    def step(self, step: int) -> tuple[float, float, float]:
        """One optimizer step (0-based): (loss, grad norm, lr). The next step's batch is read first and
        handed to the model, which prepares it while this step runs; a checkpoint keeps the loader's
        position from before that read."""
        lr = learning_rate(step, self.steps, self.lr, self.args.warmup, self.args.schedule, self.args.final_lr_frac)
        batches, counted = self.upcoming or self._next_batches()
        self.loader_state = self.train_loader.state_dict()
        self.upcoming = self._next_batches() if step + 1 < self.steps else None
        loss, norm = self.model.train_step(batches, lr, step + 1, self.opt,
                                           self.upcoming[0][0] if self.upcoming else None, counted)
        return loss, norm, lr

    def _read(self, loader: DataLoader) -> tuple[np.ndarray, np.ndarray]:
        """The loader's next (inputs, targets); with --sft the targets its loss mask leaves out are -1 (not
        counted)."""
        if not self.plan.sft:
            return loader.next_batch()
        inputs, targets, mask = loader.next_batch(with_mask=True)
        return inputs, np.where(mask == 1, targets, -1).astype(np.int32)

    def _next_batches(self) -> tuple[list, float | None]:
        """The loader's next batch as the step's micro-batches [(tokens, targets), ...], and with --sft the
        step's loss divisor on this rank (Model.train_step's counted): the counted targets of the step over all
        ranks, which one tiny all-reduce of the ranks' counts gives, divided by the number of ranks."""
        inputs, targets = self._read(self.train_loader)
        batches = list(zip(np.split(inputs, self.grad_accum), np.split(targets, self.grad_accum)))
        if not self.plan.sft:
            return batches, None
        counted = float(counted_targets(targets))
        if self.comm is not None:
            counted = float(self.comm.host_reduce([counted])[0])
        return batches, counted / self.world

    def evaluate(self) -> float:
        """The mean loss over the first --val-batches batches of the validation data (with --sft over their
        counted targets, on all ranks; 0 when none is counted)."""
        loader = self.val_loader
        loader.reset()
        n = min(self.args.val_batches, loader.batches_per_epoch)
        if not self.plan.sft:
            return mean_over_ranks(self.comm, sum(self.model.forward(*loader.next_batch()) for _ in range(n)) / n)[0]
        losses, counted = 0.0, 0
        for _ in range(n):
            inputs, targets = self._read(loader)
            batch_counted = counted_targets(targets)
            losses += self.model.forward(inputs, targets) * batch_counted
            counted += batch_counted
        losses, counted = mean_over_ranks(self.comm, losses, counted)
        return losses / counted if counted else 0.0

    def run_evaluation(self, step: int) -> None:
        """--eval's tasks on every rank's share of their items: for each, llm.c's s:<step> hella:<acc> line in
        main.log (with <key>_norm:<acc_norm> where the task reports acc_norm, <key>_ppl:<perplexity> where it
        reports perplexity), and with --eval suite the line s:<step> suite:<mean centered accuracy>."""
        self.eval_result, accuracies = [], []
        for evaluation in self.evaluations:
            task = evaluation.task
            reported = self._reported(f"step {step}: evaluating {task.name}", total=evaluation.rows, unit="choice")
            with reported as progress:
                scores = evaluation.run(self.model, progress.update if progress is not None else None)
            acc, acc_norm = accuracy_over_ranks(scores, self.comm)
            shown = {"acc_norm": acc_norm} if "acc_norm" in task.metrics else {}
            if "perplexity" in task.metrics:  # one process only (Evaluation): its scores are all the items'
                shown["ppl"] = metrics(scores, ("perplexity",))["perplexity"]
            self.eval_result.append((task.log_key, acc, shown))
            accuracies.append((task, acc))
            self.log.write(f"s:{step} {task.log_key}:{acc:.4f}" + "".join(
                f" {task.log_key}_{name.removeprefix('acc_')}:{value:.4f}" for name, value in shown.items()))
            self.progress.write(f"step {step}: {task.name} acc {acc:.4f}" +
                                "".join(f", {name} {value:.4f}" for name, value in shown.items()))
        if self.args.eval == SUITE:
            score = suite_score(accuracies)
            self.eval_result.append((SUITE, score, {}))
            self.log.write(f"s:{step} {SUITE}:{score:.4f}")
            self.progress.write(f"step {step}: suite of {len(accuracies)} tasks, mean centered accuracy {score:.4f}")
        self.eval_step = step

    def diverged(self, message: str) -> TrainingDiverged:
        self.collect_checkpoint(wait=True)  # the write in flight decides which checkpoint is the last good one
        best = best_checkpoint(self.out, self.last_good) if self.last_good else None
        also = f" (the one with the lowest probe loss is {best})" if best not in (None, self.last_good) else ""
        return TrainingDiverged(f"{message}; stopping. The last good checkpoint is "
                                f"{self.last_good or 'none (none was written)'}{also}; try a lower --lr")

    def checkpoint(self, done_steps: int) -> None:
        """Rank 0 judges the weights (io/guard.py) and writes the full state (gathered from every
        rank's shard) when they are good; every rank takes part. Bad weights at the last step stop
        the run, as there is no later checkpoint to wait for. The write runs in the background
        (collect_checkpoint), after the one before it finished: the snapshot it writes is, on one GPU, the
        state downloaded into page-locked memory (reused by every checkpoint; on the CPU plain copies), on
        several GPUs the host copies that get_params and get_optimizer_state make."""
        self.collect_checkpoint(wait=True)
        self.snapshot = self.model.download_state(self.snapshot, wait=False)  # the probe forward runs meanwhile
        trained = trained_layout(self.config, self.plan.lora).size  # with --lora the adapters
        params = (self.snapshot["params"][:trained] if self.snapshot is not None
                  else self.model.get_params())  # None on ranks other than 0
        probe_loss = self.model.forward(*self.probe_batch)  # the same batch and weights on every rank
        self.model.wait_for_state()
        verdict, reason = self.guard.judge(self.guarded(params), probe_loss) if params is not None else (SAVE, None)
        skip, stop = (value > 0 for value in mean_over_ranks(self.comm, float(verdict == SKIP),
                                                                       float(verdict == STOP)))
        if stop or (skip and done_steps == self.steps):
            raise self.diverged(f"step {done_steps - 1}: {reason or 'rank 0 refused the weights'}; "
                                "not saving a checkpoint")
        if skip:
            if reason:
                self.progress.warn(f"warning: step {done_steps - 1}: not saving a checkpoint: {reason}; "
                                   "training goes on")
            return
        adam_m, adam_v = (snapshot_moments(self.snapshot, params.size) if self.snapshot is not None
                          else self.model.get_optimizer_state())
        if self.rank != 0:
            return
        state = {"run": self.run_settings | {"world_size": self.world}, "loader": self.loader_state,
                 "sample_rng": self.sample_rng.bit_generator.state, "probe_loss": probe_loss,
                 "best_probe_loss": self.guard.best, "log_bytes": self.log.synced_size(), "args": dict(vars(self.args)),
                 "group_norms_squared": self.model.group_norms_squared, **self.adapters_state}
        out, config, keep = self.out, self.config, self.args.keep_checkpoints
        self.writer.start(lambda: save_checkpoint(out, done_steps, config, params, adam_m, adam_v, state, keep=keep))

    def guarded(self, params: np.ndarray | None) -> np.ndarray | float:
        """What the guard looks at: on one GPU the weights' RMS summed on the device (no pass over 32 GB of 8B
        weights on the host), else the host weights (params; None: the weights are on the device only), which
        also judge when the device's RMS is not finite (a weight that is not, or squares past fp32's range)."""
        if self.plan.device == "cpu" or self.comm is not None:
            return params
        rms = self.model.weights_rms()
        return rms if math.isfinite(rms) or params is None else params

    def collect_checkpoint(self, wait: bool = False) -> None:
        """Take a finished background write as the last good checkpoint (wait: the one in flight), with a
        line when it was slow; a failed write raises its CheckpointError here, which stops the run."""
        written = self.writer.collect(wait)
        if written is not None:
            self.last_good = written
            if self.writer.seconds > SLOW:
                self.progress.write(f"checkpoint {written} written in {self.writer.seconds:.1f} s")

    def sample(self, step: int) -> None:
        decoder = self.decoder or decoder_for(self.model, self.plan, max_len=self.T)
        if self.rank != 0:
            return
        sampling = Sampling(self.args.temperature, self.args.top_k, seed=int(self.sample_rng.integers(1 << 63)))
        result = generate(decoder, [self.tokenizer.bos_id], self.args.gen_tokens, sampling)
        self.progress.write(f"--- sample at step {step} ---\n{self.tokenizer.decode(result.tokens)}\n---")

    # ---- the run

    def run(self) -> int:
        """Train from self.start to self.steps; returns the exit code (0, or 130/143 when stopped by a
        signal, after a checkpoint)."""
        args = self.args
        self.loss = self.val_loss = self.val_step = self.eval_result = self.eval_step = None
        self.done, began = self.start, time.perf_counter()
        with self.run_dir.open_log(self.log_bytes) as self.log, GracefulStop() as stop, \
                TrainingProgress(self.steps, self.start, args.print_every) as self.progress:
            try:
                for step in range(self.start, self.steps):
                    if self._train_one(step, stop):
                        break
            except BaseException:
                self._finish_write_when_failing()
                raise
            self.collect_checkpoint(wait=True)
        if self.sample_every and self.done == self.steps and self.done > self.start:
            self.sample(self.steps)
        self._summary(stop, time.perf_counter() - began)
        return stop.exit_code

    def _finish_write_when_failing(self) -> None:
        """Let the write in flight finish as the run stops on an error (a further Ctrl-C stops at once): it
        is a good checkpoint. Its own failure, if any, is reported, as the error that stops the run wins."""
        if self.writer.busy:
            print("waiting for the checkpoint being written (press Ctrl-C to stop at once)", file=sys.stderr)
        try:
            self.collect_checkpoint(wait=True)
        except CheckpointError as e:
            print(f"warning: {e}", file=sys.stderr)

    def _train_one(self, step: int, stop: GracefulStop) -> bool:
        """Step `step` with what comes before (validation, a sample) and after it (logs, progress, a
        checkpoint); True when the run stops here (a signal on any rank)."""
        args, last = self.args, step == self.steps - 1
        if self.val_loader is not None and args.val_every and (step % args.val_every == 0 or last):
            self.val_loss, self.val_step = self.evaluate(), step
            self.log.write(f"s:{step} tel:{self.val_loss:.6f}")
            self.progress.write(f"step {step}: val loss {self.val_loss:.4f}")
        every = args.val_every if args.eval_every is None else args.eval_every
        if self.evaluations and ((every and step % every == 0) or last):
            self.run_evaluation(step)
        if self.sample_every and step > 0 and step % self.sample_every == 0:
            self.sample(step)
        t0 = time.perf_counter()
        loss, norm, lr = self.step(step)
        # the mean loss over ranks, and whether any rank was asked to stop: all stop at this step
        self.loss, stops = mean_over_ranks(self.comm, loss, float(stop.requested))
        if self.comm is not None:
            self.comm.beat()
        if not (math.isfinite(self.loss) and math.isfinite(norm)):
            raise self.diverged(f"step {step}: loss {self.loss}, grad norm {norm} is not finite")
        dt = time.perf_counter() - t0
        self.log.write(f"s:{step} trl:{self.loss:.6f} lr:{lr:.6e} norm:{norm:.4f}")
        self._progress(step, lr, norm, dt)
        self.done = step + 1
        self.collect_checkpoint()  # a write that failed since the last step stops the run here
        if stops > 0 or last or (args.checkpoint_every and self.done % args.checkpoint_every == 0):
            self.checkpoint(self.done)
        return stops > 0

    def _progress(self, step: int, lr: float, norm: float, dt: float) -> None:
        """The step as llm.c's line or in the bar, as the display says (llama/runtime/progress.py)."""
        peak = self.peak_flops
        mfu = self.flops_per_step / dt / peak if peak else None
        stats = [f"loss {self.loss:.4f}", f"{self.tokens_per_step / dt:,.0f} tok/s (last step)", f"lr {lr:.2e}",
                 f"norm {norm:.3f}", *([f"MFU {mfu:.1%}"] if peak else []),
                 *[f"{key} {acc:.3f}" for key, acc, _ in self.eval_result or []]]
        self.progress.step(step, step_line(step, self.steps, self.loss, lr, norm, dt, self.tokens_per_step, mfu),
                           stats)

    def _summary(self, stop: GracefulStop, elapsed: float) -> None:
        """The run in one line: where it stopped, the average rate, the last losses with their steps (as
        the step lines and the validation lines number them), the checkpoint and the log."""
        trained = self.done - self.start
        train = "n/a" if self.loss is None else f"{self.loss:.4f} at step {self.done}"
        val = "n/a" if self.val_loss is None else f"{self.val_loss:.4f} at step {self.val_step}"
        evaluated = "" if self.eval_result is None else ", ".join(
            f"{key} {acc:.4f}" + "".join(f" ({name} {value:.4f})" for name, value in shown.items())
            for key, acc, shown in self.eval_result) + f" at step {self.eval_step} | "
        stopped = stop.requested or self.done < self.steps  # here, or on another rank
        outcome = (f"stopped by {stop.name or 'another rank'} after step {self.done}/{self.steps}" if stopped
                   else f"done: step {self.done}/{self.steps}")
        rate = trained * self.tokens_per_step / max(elapsed, 1e-9)
        print(f"{outcome} | {trained} steps in {elapsed:.1f} s, {rate:,.0f} tok/s on average | train loss {train} | "
              f"val loss {val} | {evaluated}checkpoint {self.last_good} | log {self.run_dir.log_path}")
        if stopped:  # a checkpoint the guard refused leaves none to offer
            print(f"rerun with --resume to continue from {self.last_good}" if self.last_good else
                  "no checkpoint was written: nothing to resume", file=sys.stderr)
