"""The adapters of the PEFT golden fixture (tests/data/golden/peft_lora.*): scripts/record_peft_golden.py loads them
with peft.PeftModel onto transformers' model of tests/hf_helpers.py's GOLDEN_CONFIG, tests/unit/test_peft_io.py
checks our merged weights' logits against it; both draw the weights and adapters here, from seeds."""

import numpy as np

from llama.io.peft import LoraSpec, init_adapters
from tests.hf_helpers import GOLDEN_CONFIG

PEFT_GOLDEN = "peft_lora"
RECORD_PEFT_COMMAND = "PYTHONPATH=$PWD python3 scripts/record_peft_golden.py tests/data/golden"
# all seven targets at rank 4, rsLoRA (its scale is the one most easily gotten wrong), and one at rank 2 on q and v
PEFT_SPECS = {"all_r4_rslora": LoraSpec(rank=4, alpha=8.0, use_rslora=True),
              "qv_r2": LoraSpec(rank=2, alpha=16.0, targets=("q", "v"))}
ADAPTER_SEED = 11


def golden_adapters(spec: LoraSpec, config=GOLDEN_CONFIG) -> dict:
    """PEFT's initialization from ADAPTER_SEED with B drawn too (a trained adapter's: B = 0 would change nothing)."""
    adapters = init_adapters(config, spec, ADAPTER_SEED)
    rng = np.random.default_rng(ADAPTER_SEED)
    return {name: (a, (0.05 * rng.standard_normal(b.shape)).astype(np.float32)) for name, (a, b) in adapters.items()}
