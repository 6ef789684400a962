"""Export a checkpoint as a Hugging Face Llama folder that transformers (and the tools built on its
format) load: config.json, generation_config.json, safetensors weights and the tokenizer.

    python3 scripts/export_hf.py runs/d12 exported/d12               # the run's newest checkpoint, bf16
    python3 scripts/export_hf.py runs/d12/ckpt_00002000 exported/d12 --dtype fp32
    python3 scripts/export_hf.py runs/lora exported/lora-adapter --adapter   # a run with --lora: a PEFT folder
    python3 scripts/export_hf.py runs/lora exported/lora-merged --merge      # its adapters merged into the base

Then: transformers.LlamaForCausalLM.from_pretrained("exported/d12") and AutoTokenizer likewise; an adapter folder with
peft.PeftModel.from_pretrained(base, "exported/lora-adapter") on the run's base (its adapter_config.json names the
run's --init hf: folder, when it had one). --merge reads the run's base again from where the run read it (or draws it
from the run's seed), checks it is the one the adapters were trained on, and merges them into it (for --qlora into
its NF4 round trip, the weights the run trained with).
The export replaces its folder whole; a folder that holds anything but an earlier export as it was
written (llama_cuda_export.json, written last, lists its files) is refused: a training run, a
checkpoint, a Hugging Face model of your own, other files.
The tokenizer is the one the run trained with (--tokenizer, else the --init hf: folder's, else
the tokenizer in the per-user cache); a byte-level model is exported without one. A checkpoint, tokenizer
or folder that does not work is one `error:` line and exit code 2, as in the trainer; Ctrl-C stops with
exit code 130 and leaves the folder as it was.
"""

import argparse
import sys

from llama.runtime.cli import ArgumentParser, existing_path, positive_float
from llama.io.checkpoint import CheckpointError, load_checkpoint, reading_checkpoint
from llama.io.hf import (EXPORT_DTYPES, EXPORT_FILES, ExportFolderError, HFError, check_export_folder,
                         run_tokenizer_path, save_hf_folder)
from llama.io.lora_base import merged_weights
from llama.io.peft import ADAPTER_FILES, adapters_of, save_peft_adapter
from llama.data.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=existing_path,
                        help="a checkpoint folder (ckpt_*), or a run folder: its newest checkpoint")
    parser.add_argument("out", help="the folder to write")
    parser.add_argument("--dtype", choices=EXPORT_DTYPES, default="bf16", help="weight format (default: bf16)")
    parser.add_argument("--tokenizer", default=None, help="the tokenizer.model or tokenizer.json to ship")
    parser.add_argument("--max-shard-gb", type=positive_float, default=5.0,
                        help="split the weights into files of this size")
    adapters = parser.add_mutually_exclusive_group()
    adapters.add_argument("--adapter", action="store_true",
                          help="a run with LoRA adapters: write them as a PEFT adapter folder (adapter_config.json, "
                               "adapter_model.safetensors)")
    adapters.add_argument("--merge", action="store_true",
                          help="a run with LoRA adapters: write the base with the adapters merged in, a full HF folder")
    args = parser.parse_args(argv)
    try:
        check_export_folder(args.out, ADAPTER_FILES if args.adapter else EXPORT_FILES)  # before a long load
        with reading_checkpoint(args.checkpoint) as checkpoint:  # a training run's rotation leaves it meanwhile
            loaded = load_checkpoint(checkpoint)
        config, lora = loaded["config"], loaded["lora"]
        if lora is None and (args.adapter or args.merge):
            raise CheckpointError(f"{checkpoint} is a full fine-tune's, without adapters: export it without "
                                  f"--{'adapter' if args.adapter else 'merge'}")
        if lora is not None and not (args.adapter or args.merge):
            raise CheckpointError(f"{checkpoint} holds LoRA adapters: export them with --adapter (a PEFT folder), or "
                                  "the model with them merged with --merge")
        if args.adapter:
            init = loaded["state"]["base"]["init"]
            written = save_peft_adapter(args.out, config, lora, adapters_of(loaded["layout"], loaded["params"]),
                                        init[3:] if init and init.startswith("hf:") else None)
            print(f"exported the adapters of {checkpoint} to {args.out}: {', '.join(p.name for p in written)}")
            return 0
        tokenizer = load_tokenizer(args.tokenizer or run_tokenizer_path(loaded["state"]), quiet=True)
        if tokenizer.vocab_size != config.vocab_size:
            raise TokenizerError(f"the tokenizer ({tokenizer.name}, vocab {tokenizer.vocab_size}) does not fit the "
                                 f"model's vocab {config.vocab_size}; pass the run's tokenizer with --tokenizer")
        if isinstance(tokenizer, ByteTokenizer):
            print("note: a byte-level model: no tokenizer files are written", file=sys.stderr)
        params = merged_weights(loaded) if args.merge else loaded["params"]
        written = save_hf_folder(args.out, config, params, args.dtype, tokenizer,
                                 max_shard_bytes=int(args.max_shard_gb * 2**30))
    except (ExportFolderError, CheckpointError, HFError, TokenizerError, OSError, MemoryError) as e:  # as the trainer
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the export is written beside the folder and moved in whole: nothing is half done
        print(f"\ninterrupted; {args.out} is as it was", file=sys.stderr)
        return 130
    merged = " with its adapters merged" if args.merge else ""
    print(f"exported {checkpoint}{merged} to {args.out} ({args.dtype}): {', '.join(p.name for p in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
