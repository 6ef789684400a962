"""Document-masked attention against PyTorch, on rows packed with documents: our flash attention forward and
backward with the document mask (doc_start/doc_end from llama/ops/document_mask.py's document_bounds, read off
the rows' BOS tokens) against torch's flex_attention with a document block mask (torch.compile'd), SDPA run on
each document alone (is_causal), and our own kernel without the mask on the same rows, in the same run.

    python3 scripts/bench_doc_mask.py [--rows 1x8192 1x16384] [--head-dims 64 128] [--repeats 20] [--seed 0]

Each row is cut from a stream of documents of 200-3000 tokens (uniform, seeded), as the data loader cuts rows
from shards: it begins inside a document, and every later document begins with a BOS. Heads: H=32 query and
KV=8 kv heads, D=64 (Llama 3.2 1B) and D=128 (Llama 3.1 8B). On Hopper both production builds run (flash v2,
kernels/flash_attention.cu, and v3, kernels/flash_attention_wgmma.cu), elsewhere v2.

Values first: the GPU's doc_start/doc_end against the numpy twin's, then out, dq, dk, dv of ours against flex
and against SDPA per document (and flex against SDPA, torch's own spread), each as the largest elementwise
difference over the reference's largest magnitude; one above TOLERANCE stops the run (exit 1) before timing.
Then milliseconds of the forward (a training forward: it keeps what the backward needs), the backward and
both, the median of --repeats between CUDA events after warm-up (llama/runtime/cuda.py's time_ms, as
scripts/bench_attention.py times), and the speeds: each other's time over ours (above 1: ours is faster),
and ours in TFLOP/s of the work the mask leaves (2*H*D*L^2 per document of L tokens forward, 2.5x that
backward, as bench_attention.py counts the causal half). Beside them, torch's SDPA over the whole row
(causal, no document mask; bench_attention.py's bench_sdpa, forward under no_grad) and the time to build
each mask (our document_bounds kernel; flex's create_block_mask, eager), which a step pays once per
micro-batch for all its layers.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # llama, dev.cuda and scripts, run from anywhere
from dev.cuda.flash_attention_ladder import Build, FlashAttentionProblem  # noqa: E402
from llama import ops  # noqa: E402
from llama.runtime.cli import refuse, require  # noqa: E402
from llama.runtime.cuda import empty, runtime, time_ms, to_device  # noqa: E402
from llama.run.plan import ATTENTION, ATTENTION_HOPPER  # noqa: E402
from llama.twins import attention as attention_twin  # noqa: E402
from scripts.bench_attention import bench_sdpa  # noqa: E402

PROGRAM = "scripts/bench_doc_mask.py"
BOS_ID = 128000  # <|begin_of_text|> of the Llama 3 tokenizer; the other ids are drawn below it
N_HEADS, N_KV_HEADS = 32, 8  # Llama 3.2 1B's and Llama 3.1 8B's
SHORTEST, LONGEST = 200, 3000  # document lengths, tokens
TOLERANCE = 2e-2  # largest |ours - reference| over the reference's largest |value|, bf16 outputs
PASSES = (("fwd", "fwd_ms", 1.0), ("bwd", "bwd_ms", 2.5), ("fwd+bwd", "fwdbwd_ms", 3.5))  # name, key, FLOPs x fwd
GRADIENTS = ("dq", "dk", "dv")


# ---- the pure parts: the rows' documents, the work they leave, the errors and the tables


def packed_row(T: int, rng: np.random.Generator, shortest: int = SHORTEST,
               longest: int = LONGEST) -> tuple[list[tuple[int, int]], bool]:
    """One row of T tokens cut from a stream of documents of shortest..longest tokens (uniform): the
    documents' [start, end) in the row, and whether the first begins at the row's start (else the row
    begins `offset` tokens into it, offset uniform over its length)."""
    first = int(rng.integers(shortest, longest + 1))
    offset = int(rng.integers(0, first))
    segments, start, end = [], 0, min(first - offset, T)
    while True:
        segments.append((start, end))
        if end == T:
            return segments, offset == 0
        start, end = end, min(end + int(rng.integers(shortest, longest + 1)), T)


def packed_rows(B: int, T: int, seed: int, bos_id: int = BOS_ID) -> tuple[np.ndarray, list[list[tuple[int, int]]]]:
    """B rows of tokens (B, T) int32, seeded: random ids below bos_id, a BOS at each document's start (the
    first document's only where it begins in the row), and each row's documents as packed_row gives them."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, bos_id, size=(B, T), dtype=np.int32)
    rows = []
    for b in range(B):
        segments, first_begins_here = packed_row(T, rng)
        starts = [s for s, _ in segments][0 if first_begins_here else 1:]
        tokens[b, starts] = bos_id
        rows.append(segments)
    return tokens, rows


def document_flops(rows: list[list[tuple[int, int]]], n_heads: int, head_dim: int) -> int:
    """The forward's FLOPs with the document mask: 2*H*D*L^2 per document of L tokens (the causal half of
    QK^T and PV), as scripts/bench_attention.py counts a whole causal row."""
    return sum(2 * n_heads * head_dim * (end - start) ** 2 for segments in rows for start, end in segments)


def max_relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """The largest |got - want| over the largest |want|: an error that near-zero elements do not blow up."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def relative_errors(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> dict[str, float]:
    """max_relative_error of each of want's tensors (out, dq, dk, dv)."""
    return {name: max_relative_error(got[name], want[name]) for name in want}


@dataclass(frozen=True)
class Case:
    """One measured problem: rows B x T packed with `documents` documents, head dim D, and a flash build."""
    B: int
    T: int
    D: int
    documents: int
    build: str

    def cells(self) -> list[str]:
        return [f"{self.B} x {self.T}", str(self.D), str(self.documents), self.build]


def markdown(header: list[str], lines: list[list[str]]) -> str:
    """A markdown table."""
    rows = [header, ["---"] * len(header), *lines]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def error_table(results: list[tuple[Case, str, dict[str, float]]]) -> str:
    """Values: per case and comparison ('ours vs flex', ...), the errors of out, dq, dk, dv."""
    header = ["B x T", "D", "docs", "build", "compared", "out", *GRADIENTS]
    return markdown(header, [[*case.cells(), compared, *(f"{errors[k]:.2e}" for k in ("out", *GRADIENTS))]
                             for case, compared, errors in results])


def speed_table(results: list[tuple[Case, dict[str, dict[str, float]], float]]) -> str:
    """Times: per case and pass, ms of ours (masked), flex, SDPA per document, ours unmasked and SDPA over the
    whole row; the others' time over ours; ours in TFLOP/s of the masked work. results: (case, ms by method
    ('ours', 'flex', 'sdpa_doc', 'unmasked', 'sdpa_row') and pass key, the masked forward's FLOPs)."""
    header = ["B x T", "D", "docs", "build", "pass", "ours ms", "flex ms", "SDPA/doc ms", "unmasked ms",
              "SDPA row ms", "vs flex", "vs SDPA/doc", "vs unmasked", "ours TFLOP/s"]
    lines = []
    for case, ms, flops in results:
        for name, key, scale in PASSES:
            ours = ms["ours"][key]
            lines.append([*case.cells(), name, *(f"{ms[m][key]:.3f}" for m in ("ours", "flex", "sdpa_doc", "unmasked",
                                                                                "sdpa_row")),
                          *(f"{ms[m][key] / ours:.2f}x" for m in ("flex", "sdpa_doc", "unmasked")),
                          f"{scale * flops / ours / 1e9:.0f}"])
    return markdown(header, lines)


# ---- on the device


class OurAttention:
    """Our flash attention on one problem, with or without the document mask (doc_start/doc_end or None)."""

    def __init__(self, problem: FlashAttentionProblem, source, bounds=(None, None)):
        self.problem, self.source = problem, source
        self.doc_start, self.doc_end = bounds

    def forward(self) -> None:
        p = self.problem
        ops.flash_attention_forward(p.out, p.lse, p.qkv, N_HEADS, N_KV_HEADS, source=self.source,
                                    doc_start=self.doc_start, doc_end=self.doc_end)

    def backward(self) -> None:
        p = self.problem
        ops.flash_attention_backward(p.dqkv, p.scratch(Build(self.source)), p.dout, p.out, p.lse, p.qkv, N_HEADS,
                                     N_KV_HEADS, source=self.source, doc_start=self.doc_start, doc_end=self.doc_end)

    def both(self) -> None:
        self.forward()
        self.backward()

    def times(self, repeats: int) -> dict[str, float]:
        return {"fwd_ms": time_ms(self.forward, repeats=repeats, inner=1),
                "bwd_ms": time_ms(self.backward, repeats=repeats, inner=1),  # after the forwards, on their lse
                "fwdbwd_ms": time_ms(self.both, repeats=repeats, inner=1)}

    def values(self) -> dict[str, np.ndarray]:
        """out, dq, dk, dv as float32 (B, T, heads, D), after one forward and backward."""
        self.both()
        B, T, _, _, D = self.problem.shape
        qkv = self.problem.dqkv.download().astype(np.float32).reshape(B, T, -1, D)
        return {"out": self.problem.out.download().astype(np.float32).reshape(B, T, N_HEADS, D),
                "dq": qkv[:, :, :N_HEADS], "dk": qkv[:, :, N_HEADS:N_HEADS + N_KV_HEADS],
                "dv": qkv[:, :, N_HEADS + N_KV_HEADS:]}


class TorchAttention:
    """The same problem in torch: q, k, v (B, heads, T, D) bf16 leaves and dout; forward functions that
    return out (B, H, T, D): flex_attention under the document block mask, and SDPA per document."""

    def __init__(self, problem: FlashAttentionProblem, tokens: np.ndarray, rows: list[list[tuple[int, int]]], flex):
        import torch
        import torch.nn.functional as F
        from torch.nn.attention.flex_attention import create_block_mask
        B, T, H, KV, D = problem.shape
        qkv = torch.from_numpy(problem.qkv_host.astype(np.float32)).cuda().to(torch.bfloat16)
        heads = qkv.view(B, T, H + 2 * KV, D).transpose(1, 2)
        self.q, self.k, self.v = (x.contiguous().requires_grad_() for x in
                                  (heads[:, :H], heads[:, H:H + KV], heads[:, H + KV:]))
        dout = torch.from_numpy(problem.dout_host.astype(np.float32)).cuda().to(torch.bfloat16)
        self.dout = dout.view(B, T, H, D).transpose(1, 2).contiguous()
        self.rows, self.flex, self.torch, self.sdpa = rows, flex, torch, F.scaled_dot_product_attention
        documents = torch.from_numpy(attention_twin.document_ids(tokens, BOS_ID)).cuda()

        def same_document_causal(b, h, q_index, kv_index):
            return (documents[b, q_index] == documents[b, kv_index]) & (q_index >= kv_index)

        self.build_block_mask = lambda: create_block_mask(same_document_causal, B, None, T, T, device="cuda")
        self.block_mask = self.build_block_mask()

    def flex_forward(self):
        return self.flex(self.q, self.k, self.v, block_mask=self.block_mask, enable_gqa=True)

    def sdpa_forward(self):
        q, k, v = self.q, self.k, self.v
        return self.torch.cat([self.torch.cat([
            self.sdpa(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e], is_causal=True, enable_gqa=True)
            for s, e in segments], dim=2)
            for b, segments in enumerate(self.rows)])

    def gradients(self, out):
        return self.torch.autograd.grad(out, (self.q, self.k, self.v), self.dout)

    def values(self, forward) -> dict[str, np.ndarray]:
        """out, dq, dk, dv as float32 (B, T, heads, D)."""
        out = forward()
        grads = self.gradients(out)
        return {name: x.detach().transpose(1, 2).float().cpu().numpy()
                for name, x in zip(("out", *GRADIENTS), (out, *grads))}

    def times(self, forward, repeats: int) -> dict[str, float]:
        saved = forward()
        backward = lambda: self.torch.autograd.grad(saved, (self.q, self.k, self.v), self.dout,  # noqa: E731
                                                    retain_graph=True)
        return {"fwd_ms": time_ms(forward, repeats=repeats, inner=1),
                "bwd_ms": time_ms(backward, repeats=repeats, inner=1),
                "fwdbwd_ms": time_ms(lambda: self.gradients(forward()), repeats=repeats, inner=1)}


def document_bounds_on_gpu(tokens: np.ndarray):
    """doc_start, doc_end (B, T) int32 on the GPU from the tokens, checked against the numpy twin's, and the
    function that builds them again (for its time)."""
    tokens_d = to_device(tokens)
    doc_start, doc_end = empty(tokens.shape, np.int32), empty(tokens.shape, np.int32)
    build = lambda: ops.document_bounds(doc_start, doc_end, tokens_d, BOS_ID)  # noqa: E731
    build()
    want = attention_twin.document_bounds(tokens, BOS_ID)
    for name, got, expected in zip(("doc_start", "doc_end"), (doc_start.download(), doc_end.download()), want):
        if not np.array_equal(got, expected):
            bad = tuple(np.argwhere(got != expected)[0])
            refuse(f"document_bounds: {name}{bad} is {got[bad]}, the numpy twin's {expected[bad]}")
    return (doc_start, doc_end), build


class PackedProblem:
    """One row shape and head dim on the device: the packed rows, their bounds, our buffers, torch's copies."""

    def __init__(self, B: int, T: int, D: int, seed: int, flex):
        tokens, self.rows = packed_rows(B, T, seed)
        self.problem = FlashAttentionProblem(B, T, N_HEADS, N_KV_HEADS, D, seed=seed)
        self.bounds, self.build_bounds = document_bounds_on_gpu(tokens)
        self.torch_side = TorchAttention(self.problem, tokens, self.rows, flex)
        self.B, self.T, self.D = B, T, D
        self.documents = sum(len(segments) for segments in self.rows)

    def case(self, build: str) -> Case:
        return Case(self.B, self.T, self.D, self.documents, build)

    def errors(self, builds) -> list[tuple[Case, str, dict[str, float]]]:
        """Ours (each build) against flex and against SDPA per document, and flex against SDPA."""
        side = self.torch_side
        flex, sdpa = side.values(side.flex_forward), side.values(side.sdpa_forward)
        rows = [(self.case(builds[0][1]), "flex vs SDPA/doc", relative_errors(flex, sdpa))]
        for source, name in builds:
            ours = OurAttention(self.problem, source, self.bounds).values()
            rows += [(self.case(name), "ours vs flex", relative_errors(ours, flex)),
                     (self.case(name), "ours vs SDPA/doc", relative_errors(ours, sdpa))]
        return rows

    def speeds(self, builds, repeats: int) -> tuple[list, tuple[float, float]]:
        """The speed rows of every build, and the mask builds' ms (ours, flex's)."""
        side = self.torch_side
        torch_ms = {"flex": side.times(side.flex_forward, repeats), "sdpa_doc": side.times(side.sdpa_forward, repeats)}
        mask_ms = (time_ms(self.build_bounds, repeats=repeats, inner=1),
                   time_ms(side.build_block_mask, repeats=repeats, inner=1))
        self.torch_side = side = None  # its tensors, before bench_sdpa's
        torch_ms["sdpa_row"] = bench_sdpa(self.B, N_HEADS, N_KV_HEADS, self.T, self.D, repeats)
        rows = []
        for source, name in builds:
            ms = {"ours": OurAttention(self.problem, source, self.bounds).times(repeats),
                  "unmasked": OurAttention(self.problem, source).times(repeats), **torch_ms}
            rows.append((self.case(name), ms, document_flops(self.rows, N_HEADS, self.D)))
        return rows, mask_ms


def compiled_flex():
    """torch.compile'd flex_attention, or one error line where this torch has none."""
    import torch
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError as e:
        refuse(f"{PROGRAM} needs torch.nn.attention.flex_attention (torch >= 2.5), which this torch "
               f"{torch.__version__} lacks ({e}); upgrade it with python3 -m pip install -U torch")
    # the timed backward replays one graph (retain_graph=True), which buffers donated to the backward forbid
    import torch._functorch.config
    torch._functorch.config.donated_buffer = False
    return torch.compile(flex_attention, dynamic=False)


def parse_rows(text: str) -> tuple[int, int]:
    """'BxT' as (B, T)."""
    try:
        B, T = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BxT such as 1x8192, got {text!r}") from None
    if B < 1 or T < 1:
        raise argparse.ArgumentTypeError(f"expected B >= 1 and T >= 1, got {text!r}")
    return B, T


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=parse_rows, nargs="+", default=[(1, 8192), (1, 16384)], help="BxT each")
    parser.add_argument("--head-dims", type=int, nargs="+", choices=(64, 128), default=[64, 128])
    parser.add_argument("--repeats", type=int, default=20, help="timed runs of each pass (the median is kept)")
    parser.add_argument("--seed", type=int, default=0, help="of the documents' lengths and the values")
    args = parser.parse_args(argv)
    require(PROGRAM, ("torch",), gpu=True)
    flex = compiled_flex()
    builds = [ATTENTION, ATTENTION_HOPPER] if runtime().code == "sm_90a" else [ATTENTION]
    print(f"device: {runtime().name}; H={N_HEADS} KV={N_KV_HEADS}; documents of {SHORTEST}-{LONGEST} tokens, "
          f"seed {args.seed}", flush=True)
    errors, speeds, failed = [], [], False
    for B, T in args.rows:
        for D in args.head_dims:
            problem = PackedProblem(B, T, D, args.seed, flex)
            case_errors = problem.errors(builds)
            errors += case_errors
            if any(e > TOLERANCE for _, compared, row in case_errors if compared.startswith("ours")
                   for e in row.values()):
                failed = True
                continue
            case_speeds, mask_ms = problem.speeds(builds, args.repeats)
            speeds += case_speeds
            left = document_flops(problem.rows, N_HEADS, D) / (2 * B * N_HEADS * D * T * T)
            print(f"{B} x {T}, D={D}: {problem.documents} documents leave {left:.1%} of the causal work; "
                  f"mask build {mask_ms[0]:.3f} ms (document_bounds), {mask_ms[1]:.3f} ms (flex's create_block_mask)",
                  flush=True)
    print(f"\nValues: largest |difference| over the reference's largest |value| (tolerance {TOLERANCE:.0e})\n")
    print(error_table(errors))
    if failed:
        print(f"error: ours is off by more than {TOLERANCE:.0e} (table above); not timed", file=sys.stderr)
        return 1
    print("\nTimes (median ms); vs: the other's time over ours (above 1: ours is faster); TFLOP/s of the masked "
          "work\n")
    print(speed_table(speeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
