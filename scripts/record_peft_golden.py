"""Record what peft.PeftModel computes with our adapter folders, the golden fixture of our PEFT export and merge
(llama/io/peft.py; checked by tests/unit/test_peft_io.py without torch). Run where torch, transformers and peft are
installed (the GPU machine), from the repository root, and commit tests/data/golden/peft_lora.json and .npz:

    PYTHONPATH=$PWD python3 scripts/record_peft_golden.py tests/data/golden

For each of tests/peft_golden.py's specs: our fp32 export of tests/hf_helpers.py's seeded golden model
(save_hf_folder) loaded by transformers, our adapter folder of its seeded adapters (save_peft_adapter) loaded
onto it by peft.PeftModel.from_pretrained, and in float64: the logits of fixed tokens, and after
merge_and_unload the merged q_proj and k_proj of layer 0 (HF layout) and the merged model's logits.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from llama.io.hf import save_hf_folder
from llama.io.peft import save_peft_adapter
from tests.hf_helpers import GOLDEN_CONFIG, golden_tokens, hf_logits, seeded_params, sha256, write_fixture
from tests.peft_golden import ADAPTER_SEED, PEFT_GOLDEN, PEFT_SPECS, golden_adapters
from scripts.record_golden import provenance


def record_spec(name: str, folder: Path) -> tuple[dict, dict[str, np.ndarray]]:
    import peft
    import transformers

    spec, config = PEFT_SPECS[name], GOLDEN_CONFIG
    params = seeded_params(config)
    save_hf_folder(folder / "base", config, params, "fp32")
    adapter_files = save_peft_adapter(folder / name, config, spec, golden_adapters(spec))
    base = transformers.LlamaForCausalLM.from_pretrained(folder / "base").eval()  # float32, as config.json says
    model = peft.PeftModel.from_pretrained(base, folder / name).double().eval()
    tokens = golden_tokens(config.vocab_size, 2, 16, seed=3)
    logits = hf_logits(model, tokens)
    layers = model.base_model.model.model.layers
    scaling = float(layers[0].self_attn.q_proj.scaling["default"]) if "q" in spec.targets else None
    merged = model.merge_and_unload()
    layer = merged.model.layers[0].self_attn
    arrays = {f"{name}.tokens": tokens, f"{name}.logits": logits, f"{name}.merged_logits": hf_logits(merged, tokens),
              f"{name}.q_proj": layer.q_proj.weight.detach().numpy(),
              f"{name}.k_proj": layer.k_proj.weight.detach().numpy()}
    facts = {"spec": {"rank": spec.rank, "alpha": spec.alpha, "targets": list(spec.targets),
                      "use_rslora": spec.use_rslora},
             "files": {p.name: sha256(p.read_bytes()) for p in adapter_files}, "scaling": scaling}
    return facts, arrays


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("out_dir", type=Path, help="where the fixture goes (tests/data/golden)")
    args = parser.parse_args(argv)
    import peft

    args.out_dir.mkdir(parents=True, exist_ok=True)
    facts = {**provenance(GOLDEN_CONFIG, seeded_params(GOLDEN_CONFIG)), "made_by": "scripts/record_peft_golden.py",
             "adapter_seed": ADAPTER_SEED, "specs": {}}
    facts["versions"]["peft"] = peft.__version__
    arrays = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in PEFT_SPECS:
            facts["specs"][name], spec_arrays = record_spec(name, Path(tmp))
            arrays.update(spec_arrays)
    write_fixture(args.out_dir, PEFT_GOLDEN, facts, {k: (v.astype(np.float32) if v.dtype == np.float64 else v)
                                                     for k, v in arrays.items()})
    print(f"recorded {PEFT_GOLDEN} ({', '.join(PEFT_SPECS)}; peft {peft.__version__}) in {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
