"""Tokenizers: Meta's Llama 3 tokenizer on tiktoken, and a byte-level fallback that needs no file.

The Llama 3 tokenizer reads a `tokenizer.model` (lines of `base64(token) rank`) or the same ranks
from a Hugging Face `tokenizer.json`, splits text with Meta's pattern and appends 256 special
tokens after the ranks (ids 128000..128255 for the real file). It encodes chat messages in the
Llama 3 format and writes itself out as a tokenizer.json that transformers loads. The byte-level
tokenizer maps each UTF-8 byte to its value and adds two special tokens; it is used only when no
Llama 3 tokenizer is available, and says so.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import numpy as np

from ..cache import cache_dir

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
NUM_SPECIAL_TOKENS = 256
BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
CHAT_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "ipython", "ipython": "ipython"}


def llama3_special_tokens() -> list[str]:
    """Meta's 256 special tokens, in id order."""
    named = [BEGIN_OF_TEXT, END_OF_TEXT, "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
             "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>",
             "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    return named + [f"<|reserved_special_token_{2 + i}|>" for i in range(NUM_SPECIAL_TOKENS - len(named))]


class TokenizerError(ValueError):
    """A tokenizer file that cannot be read."""


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet, in which Hugging Face's tokenizer.json writes token bytes:
    printable bytes stand for themselves, the others for the code points from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def ranks_from_hf_json(data: dict, path: Path) -> dict[bytes, int]:
    """The BPE ranks of a Llama 3 tokenizer.json (byte-level BPE with Meta's split pattern)."""
    model = data.get("model") if isinstance(data, dict) else None
    pre = json.dumps(data.get("pre_tokenizer")) if isinstance(data, dict) else ""
    if not isinstance(model, dict) or model.get("type") != "BPE" or json.dumps(LLAMA3_PATTERN) not in pre:
        raise TokenizerError(f"{path} is not a Llama 3 tokenizer (byte-level BPE with Meta's split pattern)")
    added = {t["id"] for t in data.get("added_tokens", [])}
    decode = {c: b for b, c in byte_to_unicode().items()}
    try:
        return {bytes(decode[c] for c in token): rank for token, rank in model["vocab"].items() if rank not in added}
    except KeyError:
        raise TokenizerError(f"{path}: a vocabulary entry is not in the byte-level alphabet") from None


EXPECTED_FILES = ("Meta's tokenizer.model (one base64 token and its rank a line) or a Hugging Face "
                  "tokenizer.json")


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A tokenizer.model: one `base64(token) rank` per line. Read here rather than with tiktoken's
    loader, which caches files by their path string (a relative path such as tokenizer/tokenizer.model
    would return the contents of whichever file was first read there)."""
    ranks = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:  # not two fields, not base64 (binascii.Error), not an integer
            raise TokenizerError(f"{path} is not a tokenizer: line {number} is not a base64 token and its rank; "
                                 f"expected {EXPECTED_FILES}") from None
    return ranks


def load_ranks(path: Path) -> dict[bytes, int]:
    """Ranks from a tokenizer.model (tiktoken format) or a Hugging Face tokenizer.json."""
    try:
        if path.suffix == ".json":
            return ranks_from_hf_json(json.loads(path.read_text(encoding="utf-8")), path)
        return read_tiktoken_ranks(path)
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer file not found: {path}") from None
    except IsADirectoryError:
        raise TokenizerError(f"{path} is a folder; expected {EXPECTED_FILES}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise TokenizerError(f"{path} is not a tokenizer.json (not JSON text); expected {EXPECTED_FILES}") from None
    except OSError as e:
        raise TokenizerError(f"cannot read tokenizer file {path}: {e.strerror or e}") from None


class Llama3Tokenizer:
    """Meta's Llama 3 tokenizer. encode() treats special-token text in the input as plain text."""

    # encode(a + b) == encode(a) + encode(b) where b begins a line with a non-space character (a ends in a line
    # break): the split pattern ends a piece there (llama/eval/scoring.py LINE_START says why)
    splits_at_line_starts = True

    def __init__(self, model_path: str | Path):
        import tiktoken

        path = Path(model_path)
        self.ranks = ranks = load_ranks(path)
        n = len(ranks)
        if sorted(ranks.values()) != list(range(n)):
            raise TokenizerError(f"{path}: the token ranks are not 0..{n - 1}")
        self.special_tokens = {tok: n + i for i, tok in enumerate(llama3_special_tokens())}
        self.encoding = tiktoken.Encoding(name=path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                          special_tokens=self.special_tokens)
        self.name = f"llama3:{path}"
        self.vocab_size = n + NUM_SPECIAL_TOKENS
        self.bos_id = self.special_tokens[BEGIN_OF_TEXT]
        self.eos_id = self.special_tokens[END_OF_TEXT]
        self.eot_id = self.special_tokens["<|eot_id|>"]
        # generation ends at the end of the text, of a message (tool call) or of a turn, as in Meta's code
        self.stop_ids = (self.eos_id, self.special_tokens["<|eom_id|>"], self.eot_id)

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids = self.encoding.encode(text, allowed_special=set(), disallowed_special=())
        return [self.bos_id] + ids if bos else ids

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Raw bytes (a file's contents) as uint32 ids; invalid UTF-8 becomes U+FFFD."""
        return np.asarray(self.encode(data.decode("utf-8", errors="replace")), dtype=np.uint32)

    def decode(self, ids) -> str:
        return self.encoding.decode([int(i) for i in ids])

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one id (a special token's name for the special ids), for streaming."""
        return self.encoding.decode_single_token_bytes(int(token))

    def encode_header(self, role: str) -> list[int]:
        """<|start_header_id|>role<|end_header_id|> and the blank line after it."""
        if role not in CHAT_ROLES:
            raise ValueError(f"unknown chat role {role!r}; use one of {', '.join(CHAT_ROLES)}")
        return [self.special_tokens["<|start_header_id|>"], *self.encode(CHAT_ROLES[role]),
                self.special_tokens["<|end_header_id|>"], *self.encode("\n\n")]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """A dialog as Meta's ChatFormat.encode_dialog_prompt writes it: <|begin_of_text|>, each
        message as header + content + <|eot_id|>, then the assistant header for the reply.
        messages: [{"role": "system" | "user" | "assistant" | "tool", "content": str}, ...]."""
        ids = [self.bos_id]
        for message in messages:
            ids += self.encode_header(message["role"]) + self.encode(message["content"]) + [self.eot_id]
        return ids + self.encode_header("assistant")


CHAT_TEMPLATE = ("{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
                 "'<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}{%- endfor %}"
                 "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


def hf_tokenizer_files(tokenizer: Llama3Tokenizer, model_max_length: int) -> dict[str, dict]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json for transformers:
    byte-level BPE whose vocabulary is the tiktoken ranks (in GPT-2's byte alphabet) and whose
    merges are every split of a token into two tokens, ordered by the merged token's rank
    (transformers' own tiktoken conversion), so that both tokenizers produce the same ids."""
    ranks, alphabet = tokenizer.ranks, byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        splits = [(ranks[token[:i]], ranks[token[i:]], token[:i], token[i:]) for i in range(1, len(token))
                  if token[:i] in ranks and token[i:] in ranks]
        merges += [[text(left), text(right)] for _, _, left, right in sorted(splits)]
    bos = {"SpecialToken": {"id": BEGIN_OF_TEXT, "type_id": 0}}
    tokenizer_json = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for name, i in tokenizer.special_tokens.items()],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {"type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos,
                                    {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {BEGIN_OF_TEXT: {"id": BEGIN_OF_TEXT, "ids": [tokenizer.bos_id],
                                                              "tokens": [BEGIN_OF_TEXT]}}},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {text(token): rank for token, rank in ranks.items()}, "merges": merges},
    }
    special_map = {"bos_token": BEGIN_OF_TEXT, "eos_token": END_OF_TEXT}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special_map, "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, "model_input_names": ["input_ids", "attention_mask"],
              "chat_template": CHAT_TEMPLATE}
    return {"tokenizer.json": tokenizer_json, "tokenizer_config.json": config, "special_tokens_map.json": special_map}


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then <|begin_of_text|> = 256 and <|end_of_text|> = 257; ids 258..263
    are reserved so that the vocabulary is a multiple of 8 (bf16 rows of logits and weights stay
    16-byte aligned for the tensor-core kernels). The reserved ids are never produced by encode, but
    a model may still sample them: they decode to nothing."""

    name = "bytes"
    vocab_size = 264
    bos_id = 256
    eos_id = 257
    special_tokens = {BEGIN_OF_TEXT: 256, END_OF_TEXT: 257}
    stop_ids = (257,)
    splits_at_line_starts = True  # as Llama3Tokenizer's: a byte a token

    def encode(self, text: str, bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8", errors="surrogateescape"))
        return [self.bos_id] + ids if bos else ids

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Any bytes, valid UTF-8 or not, as uint32 ids."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint32)

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """A byte's own value, a special token's name, and nothing for a reserved id."""
        token = int(token)
        if token < 256:
            return bytes([token])
        return next((name.encode() for name, i in self.special_tokens.items() if i == token), b"")


def default_tokenizer_path() -> Path:
    """Where the Llama 3 tokenizer is kept and fetched to: the per-user cache (llama/cache.py)."""
    return cache_dir() / "tokenizer" / "tokenizer.model"


def load_tokenizer(path: str | Path | None = None, quiet: bool = False, fetch: bool = False):
    """The Llama 3 tokenizer from `path` (tokenizer.model or tokenizer.json), or from the cache's
    tokenizer/tokenizer.model when it exists. Otherwise, with fetch, that file is fetched from the
    llama-models wheel (one note on stderr; no retries, so an offline machine moves on at once);
    failing that, the byte-level tokenizer, announced on stderr. A path given but missing is an error."""
    if path is not None:
        return Llama3Tokenizer(path)
    default = default_tokenizer_path()
    if default.exists():
        return Llama3Tokenizer(default)
    if fetch:
        from .tokenizer_fetch import FetchError, fetch_llama3_tokenizer
        print(f"note: no Llama 3 tokenizer at {default}; fetching it from Meta's llama-models wheel on the Python "
              "package index", file=sys.stderr)
        try:
            return Llama3Tokenizer(fetch_llama3_tokenizer(default, timeout=5.0, retries=0))
        except FetchError as e:
            print(f"note: {e}", file=sys.stderr)
    if not quiet:
        print(f"note: no Llama 3 tokenizer at {default}; using the byte-level tokenizer (vocab 264). Get the real "
              "one with: python3 scripts/download_starter_pack.py", file=sys.stderr)
    return ByteTokenizer()
