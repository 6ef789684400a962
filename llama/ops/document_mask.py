"""The document mask's bounds (kernels/document_mask.cu; twin llama/twins/attention.py's document_bounds): each
token's document start and end from the BOS tokens of its row, the form the attention launchers take the mask in
(flash_attention_forward/backward's and attention_forward/backward's doc_start, doc_end)."""

from __future__ import annotations

from ..runtime.cuda import DeviceArray
from .common import I32, check, kernel, kernel_constant

BOUNDS_THREADS = kernel_constant("document_mask", "BOUNDS_THREADS")


def document_bounds(doc_start: DeviceArray, doc_end: DeviceArray, tokens: DeviceArray, bos_id: int) -> None:
    """doc_start (B, T) int32: the last BOS position at or before each token of tokens (B, T) int32, else 0;
    doc_end (B, T) int32: the first BOS position after it, else T."""
    if not isinstance(tokens, DeviceArray) or len(tokens.shape) != 2:
        raise ValueError(f"tokens: expected an int32 DeviceArray (B, T), got {tokens!r}")
    check("tokens", tokens, tokens.shape, I32)
    check("doc_start", doc_start, tokens.shape, I32)
    check("doc_end", doc_end, tokens.shape, I32)
    B, T = tokens.shape
    kernel("document_mask", "document_bounds", "PPPii")((B,), BOUNDS_THREADS, doc_start.ptr, doc_end.ptr, tokens.ptr,
                                                        T, bos_id)


def check_document_bounds(doc_start: DeviceArray | None, doc_end: DeviceArray | None, B: int, T: int) -> tuple[int, int]:
    """The pointers an attention kernel takes for its document mask: (0, 0) when both are None (plain causal),
    else both, checked (B, T) int32."""
    if doc_start is None and doc_end is None:
        return 0, 0
    if doc_start is None or doc_end is None:
        raise ValueError("doc_start and doc_end: pass both (document mask) or neither")
    check("doc_start", doc_start, (B, T), I32)
    check("doc_end", doc_end, (B, T), I32)
    return doc_start.ptr, doc_end.ptr
