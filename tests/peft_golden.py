"""The adapters of the PEFT golden fixture (tests/data/golden/peft_lora.*): scripts/record_peft_golden.py loads them
with peft.PeftModel onto transformers' model of tests/hf_helpers.py's GOLDEN_CONFIG, tests/unit/test_peft_io.py
checks our merged weights' logits against it; both draw the weights and adapters here, from seeds."""

import numpy as np

from llama.io.peft import adapted_weights
from llama.params import LoraSpec
from llama.twins.lora import lora_init
from tests.hf_helpers import GOLDEN_CONFIG

PEFT_GOLDEN = "peft_lora"
RECORD_PEFT_COMMAND = "PYTHONPATH=$PWD python3 scripts/record_peft_golden.py tests/data/golden"
# all seven targets at rank 4, rsLoRA (its scale is the one most easily gotten wrong), and one at rank 2 on q and v
PEFT_SPECS = {"all_r4_rslora": LoraSpec(rank=4, alpha=8.0, use_rslora=True),
              "qv_r2": LoraSpec(rank=2, alpha=16.0, targets=("q", "v"))}
ADAPTER_SEED = 11


def golden_adapters(spec: LoraSpec, config=GOLDEN_CONFIG) -> dict:
    """PEFT's initialization from ADAPTER_SEED with B drawn too (a trained adapter's: B = 0 would change nothing);
    each A drawn at the offset it had when the fixture was recorded: weight after weight, each A then B."""
    rng, adapters, offset = np.random.default_rng(ADAPTER_SEED), {}, 0
    for name, (a_shape, b_shape) in adapted_weights(config, spec).items():
        a, b = lora_init(ADAPTER_SEED, offset, a_shape[0], a_shape[1], b_shape[0])
        adapters[name] = (a, (0.05 * rng.standard_normal(b.shape)).astype(np.float32))
        offset += a.size + b.size
    return adapters
