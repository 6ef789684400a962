"""Export a checkpoint as a Hugging Face Llama folder that transformers (and the tools built on its
format) load: config.json, generation_config.json, safetensors weights and the tokenizer.

    python3 scripts/export_hf.py runs/d12 exported/d12               # the run's newest checkpoint, bf16
    python3 scripts/export_hf.py runs/d12/ckpt_00002000 exported/d12 --dtype fp32

Then: transformers.LlamaForCausalLM.from_pretrained("exported/d12") and AutoTokenizer likewise.
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
from llama.io.hf import EXPORT_DTYPES, ExportFolderError, check_export_folder, run_tokenizer_path, save_hf_folder
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
    args = parser.parse_args(argv)
    try:
        check_export_folder(args.out)  # before a long load
        with reading_checkpoint(args.checkpoint) as checkpoint:  # a training run's rotation leaves it meanwhile
            loaded = load_checkpoint(checkpoint)
        config = loaded["config"]
        tokenizer = load_tokenizer(args.tokenizer or run_tokenizer_path(loaded["state"]), quiet=True)
        if tokenizer.vocab_size != config.vocab_size:
            raise TokenizerError(f"the tokenizer ({tokenizer.name}, vocab {tokenizer.vocab_size}) does not fit the "
                                 f"model's vocab {config.vocab_size}; pass the run's tokenizer with --tokenizer")
        if isinstance(tokenizer, ByteTokenizer):
            print("note: a byte-level model: no tokenizer files are written", file=sys.stderr)
        written = save_hf_folder(args.out, config, loaded["params"], args.dtype, tokenizer,
                                 max_shard_bytes=int(args.max_shard_gb * 2**30))
    except (ExportFolderError, CheckpointError, TokenizerError, OSError, MemoryError) as e:  # as the trainer: 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the export is written beside the folder and moved in whole: nothing is half done
        print(f"\ninterrupted; {args.out} is as it was", file=sys.stderr)
        return 130
    print(f"exported {checkpoint} to {args.out} ({args.dtype}): {', '.join(p.name for p in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
