"""Tokenizers: Meta's Llama 3 tokenizer on tiktoken, and a byte-level fallback that needs no file.

The Llama 3 tokenizer reads a `tokenizer.model` (lines of `base64(token) rank`), splits text with
Meta's pattern and appends 256 special tokens after the ranks (ids 128000..128255 for the real
file). The byte-level tokenizer maps each UTF-8 byte to its value and adds two special tokens; it
is used only when no tokenizer.model is available, and says so.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
NUM_SPECIAL_TOKENS = 256
BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"


def llama3_special_tokens() -> list[str]:
    """Meta's 256 special tokens, in id order."""
    named = [BEGIN_OF_TEXT, END_OF_TEXT, "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
             "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>",
             "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    return named + [f"<|reserved_special_token_{2 + i}|>" for i in range(NUM_SPECIAL_TOKENS - len(named))]


class TokenizerError(ValueError):
    """A tokenizer file that cannot be read."""


class Llama3Tokenizer:
    """Meta's Llama 3 tokenizer. encode() treats special-token text in the input as plain text."""

    def __init__(self, model_path: str | Path):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        path = Path(model_path)
        try:
            ranks = load_tiktoken_bpe(str(path))
        except FileNotFoundError:
            raise TokenizerError(f"tokenizer file not found: {path}") from None
        except Exception as e:
            raise TokenizerError(f"cannot read tokenizer file {path}: {e}") from None
        n = len(ranks)
        self.special_tokens = {tok: n + i for i, tok in enumerate(llama3_special_tokens())}
        self.encoding = tiktoken.Encoding(name=path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                          special_tokens=self.special_tokens)
        self.name = f"llama3:{path}"
        self.vocab_size = n + NUM_SPECIAL_TOKENS
        self.bos_id = self.special_tokens[BEGIN_OF_TEXT]
        self.eos_id = self.special_tokens[END_OF_TEXT]

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids = self.encoding.encode(text, allowed_special=set(), disallowed_special=())
        return [self.bos_id] + ids if bos else ids

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Raw bytes (a file's contents) as uint32 ids; invalid UTF-8 becomes U+FFFD."""
        return np.asarray(self.encode(data.decode("utf-8", errors="replace")), dtype=np.uint32)

    def decode(self, ids) -> str:
        return self.encoding.decode([int(i) for i in ids])


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then <|begin_of_text|> = 256 and <|end_of_text|> = 257; ids 258..263
    are reserved and never produced, so that the vocabulary is a multiple of 8 (bf16 rows of logits
    and weights stay 16-byte aligned for the tensor-core kernels)."""

    name = "bytes"
    vocab_size = 264
    bos_id = 256
    eos_id = 257
    special_tokens = {BEGIN_OF_TEXT: 256, END_OF_TEXT: 257}

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8", errors="surrogateescape"))
        return [self.bos_id] + ids if bos else ids

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Any bytes, valid UTF-8 or not, as uint32 ids."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint32)

    def decode(self, ids) -> str:
        names = {v: k for k, v in self.special_tokens.items()}
        out, run = [], bytearray()
        for i in (int(i) for i in ids):
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            out.append(names.get(i, ""))
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


DEFAULT_TOKENIZER_PATH = Path("data") / "tokenizer" / "tokenizer.model"


def load_tokenizer(path: str | Path | None = None, quiet: bool = False):
    """The Llama 3 tokenizer from `path` (or data/tokenizer/tokenizer.model when it exists);
    otherwise the byte-level tokenizer, announced on stderr. A path given but missing is an error."""
    if path is not None:
        return Llama3Tokenizer(path)
    if DEFAULT_TOKENIZER_PATH.exists():
        return Llama3Tokenizer(DEFAULT_TOKENIZER_PATH)
    if not quiet:
        print(f"note: no Llama 3 tokenizer at {DEFAULT_TOKENIZER_PATH}; using the byte-level tokenizer "
              "(vocab 264). Get the real one with: python scripts/download_starter_pack.py --hf-token ...",
              file=sys.stderr)
    return ByteTokenizer()
