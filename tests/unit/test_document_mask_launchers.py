"""The document mask's launcher arguments are checked before touching the device (so this runs without a GPU: the
arrays are descriptors of no memory): ops.document_bounds, and doc_start, doc_end of the flash and fp32 attention."""

import numpy as np
import pytest

from llama import ops
from llama.runtime.cuda import BF16
from tests.unit.test_flash_attention_launcher import B, D, H, KV, T, backward_args, fake, forward_args

I32, F32 = np.int32, np.float32
BOUNDS = (B, T)


def bounds(**changes):
    return {"doc_start": fake(BOUNDS, I32), "doc_end": fake(BOUNDS, I32)} | changes


BAD_BOUNDS = [
    ({"doc_end": None}, "doc_start and doc_end: pass both"),
    ({"doc_start": None}, "doc_start and doc_end: pass both"),
    ({"doc_start": fake((B, T + 1), I32)}, "doc_start: expected int32 \\(2, 10\\)"),
    ({"doc_end": fake(BOUNDS, F32)}, "doc_end: expected int32"),
]


@pytest.mark.parametrize("changes, message", BAD_BOUNDS)
def test_flash_forward_rejects(changes, message):
    with pytest.raises(ValueError, match=message):
        ops.flash_attention_forward(**forward_args(**bounds(**changes)))


@pytest.mark.parametrize("changes, message", BAD_BOUNDS)
def test_flash_backward_rejects(changes, message):
    with pytest.raises(ValueError, match=message):
        ops.flash_attention_backward(**backward_args(**bounds(**changes)))


def test_a_build_without_the_mask_rejects_it():
    """Every production build takes the mask; a ladder rung may not (dev/cuda's v1), and then a mask is refused."""
    assert ops.FlashSource().document_mask and ops.FlashSource("flash_attention_wgmma", tma=True).document_mask
    unmasked = ops.FlashSource("flash_attention_v1", document_mask=False)
    with pytest.raises(ValueError, match="flash_attention_v1 has no document mask"):
        ops.flash_attention_forward(**forward_args(source=unmasked, **bounds()))
    with pytest.raises(ValueError, match="flash_attention_v1 has no document mask"):
        ops.flash_attention_backward(**backward_args(source=unmasked, **bounds()))


def attention_args(**changes):
    return {"out": fake((B, T, H * D), F32), "probs": fake((B, H, T, T), F32), "heads": fake((B, H, T, D), F32),
            "q": fake((B, H, T, D), F32), "k": fake((B, KV, T, D), F32), "v": fake((B, KV, T, D), F32)} | changes


@pytest.mark.parametrize("changes, message", BAD_BOUNDS)
def test_fp32_attention_rejects(changes, message):
    with pytest.raises(ValueError, match=message):
        ops.attention_forward(**attention_args(**bounds(**changes)))
    args = attention_args()
    backward = {"dq": args["q"], "dk": args["k"], "dv": args["v"], "dprobs": args["probs"], "dheads": args["heads"],
                "dout": args["out"], "q": args["q"], "k": args["k"], "v": args["v"], "probs": args["probs"]}
    with pytest.raises(ValueError, match=message):
        ops.attention_backward(**backward, **bounds(**changes))


@pytest.mark.parametrize("changes, message", [
    ({"tokens": fake((B * T,), I32)}, "tokens: expected an int32 DeviceArray \\(B, T\\)"),
    ({"tokens": fake(BOUNDS, np.int64)}, "tokens: expected int32"),
    ({"doc_start": fake((B, T - 1), I32)}, "doc_start: expected int32 \\(2, 10\\)"),
    ({"doc_end": fake(BOUNDS, BF16)}, "doc_end: expected int32"),
])
def test_document_bounds_rejects(changes, message):
    args = {"doc_start": fake(BOUNDS, I32), "doc_end": fake(BOUNDS, I32), "tokens": fake(BOUNDS, I32),
            "bos_id": 128000} | changes
    with pytest.raises(ValueError, match=message):
        ops.document_bounds(**args)
