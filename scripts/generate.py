"""Generate text from a checkpoint or a Hugging Face Llama folder, streaming it as it comes, with a
KV cache: on the GPU with our kernels (bf16 weights and cache, sampling on the GPU, one CUDA graph per
token), else on the CPU with the numpy reference.

    python3 scripts/generate.py runs/d12 --prompt "To be, or not to be"
    python3 scripts/generate.py Llama-3.2-1B-Instruct --chat --prompt "Name three rivers." -n 200
    echo "Once upon a time" | python3 scripts/generate.py runs/d12/ckpt_00002000 --temperature 0.8 --top-p 0.9

MODEL is a checkpoint folder, a run folder (its newest checkpoint) or a folder with config.json and
safetensors (also written hf:PATH). --chat wraps the prompt in the Llama 3 chat format (for instruct
models) and stops at the end of the turn. Tokens/s of prefill and decode go to stderr.
A model, tokenizer or prompt that does not work is one `error:` line and exit code 2, as in the trainer;
Ctrl-C stops the text where it is, with exit code 130.
"""

import argparse
import sys

import numpy as np

from llama.runtime.cli import ArgumentParser, existing_path, fraction, nonnegative_float, nonnegative_int, positive_int
from llama.io.checkpoint import CheckpointError
from llama.io.model_folder import load_model
from llama.model.generate import TextStream, generate
from llama.model.reference import ReferenceDecoder
from llama.model.sampling import Sampling
from llama.io.hf import HFError
from llama.runtime.kernel_build import build, kernels_for
from llama.options import DEVICES, RunOptions
from llama.run.plan import Plan, make_plan
from llama.data.tokenizer import Llama3Tokenizer, TokenizerError


def make_decoder(plan: Plan, config, params: np.ndarray, max_len: int):
    if plan.device == "cpu":
        return ReferenceDecoder(config, params, max_len=max_len)
    from llama.runtime.cuda import runtime, to_device
    from llama.model.gpu_decoder import GPUDecoder
    # in parallel, one line on screen unless cached
    build(kernels_for(plan, runtime().code, decoder=True, head_dim=config.head_dim))
    decoder = GPUDecoder(config, plan, to_device(params), max_len=max_len)
    decoder.forward(np.zeros((1, 2), dtype=np.int64))  # loads the kernels, so that the timings leave that out
    decoder.forward(np.zeros((1, 1), dtype=np.int64))
    decoder.reset()
    return decoder


def read_prompt() -> str:
    """The prompt from stdin; on a terminal, after a line that says how to end it."""
    if sys.stdin.isatty():
        print("reading the prompt from the terminal: type it, then press Ctrl-D on a line of its own (or pass --prompt)",
              file=sys.stderr)
    return sys.stdin.read()


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=existing_path, help="checkpoint folder, run folder, or Hugging Face folder")
    p.add_argument("--prompt", default=None, help="the prompt (default: read from stdin)")
    p.add_argument("--chat", action="store_true", help="Llama 3 chat format: the prompt is the user's message")
    p.add_argument("--system", default=None, help="with --chat: a system message first")
    p.add_argument("-n", "--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--temperature", type=nonnegative_float, default=0.7, help="0: greedy")
    p.add_argument("--top-k", type=nonnegative_int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=fraction, default=0.9,
                   help="nucleus sampling mass (1: off; 0: the likeliest token only)")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--tokenizer", default=None, help="tokenizer.model or tokenizer.json (default: the model's)")
    p.add_argument("--device", choices=DEVICES, default=None, help="default: cuda if usable, else cpu")
    args = p.parse_args(argv)
    try:
        config, params, tokenizer = load_model(args.model, args.tokenizer)
        prompt = args.prompt if args.prompt is not None else read_prompt()
        if args.chat:
            if not isinstance(tokenizer, Llama3Tokenizer):
                raise TokenizerError("--chat needs the Llama 3 tokenizer")
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                [{"role": "user", "content": prompt}]
            ids, stop_ids = tokenizer.encode_chat(messages), tokenizer.stop_ids
        else:
            ids, stop_ids = tokenizer.encode(prompt, bos=True), (tokenizer.eos_id,)
        max_len = min(config.max_seq_len, len(ids) + args.max_new_tokens)
        if len(ids) >= max_len:
            raise ValueError(f"the prompt ({len(ids)} tokens) leaves no room in the model's {config.max_seq_len}")
        if max_len - len(ids) < args.max_new_tokens:
            print(f"note: the model's context is {config.max_seq_len} tokens and the prompt takes {len(ids)}: at most "
                  f"{max_len - len(ids)} new tokens, not -n {args.max_new_tokens}", file=sys.stderr)
        plan = make_plan(config, RunOptions(args.device))
        decoder = make_decoder(plan, config, params, max_len)
        if not args.chat:
            sys.stdout.write(prompt)
        stream = TextStream(tokenizer)
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
        result = generate(decoder, ids, args.max_new_tokens, sampling, stop_ids,
                          lambda token: token in stop_ids or stream(token))
        stream.finish()
    except (CheckpointError, HFError, TokenizerError, ValueError, OSError, MemoryError) as e:  # PlanError too
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # the GPU's
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    print(file=sys.stdout)
    print(f"[{plan.device}] {result.speeds()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
