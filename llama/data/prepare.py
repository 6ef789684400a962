"""Documents into token shards: the logic of scripts/prepare_data.py.

Inputs are files, folders (searched recursively) and globs of
  .txt      a file is a document;
  .jsonl    a line is a document: {"text": ...} (the field is text_field), or a conversation
            {"messages": [{"role": "system" | "user" | "assistant", "content": ...}, ...]};
  .json     an array of such objects (TinyStories' files), read whole;
  .parquet  a row is a document, its text_field column (needs pyarrow).
The data is chat when the first document is a conversation; then every document must be one.

Every document is framed as torchtitan's Llama 3 pipeline frames it: <|begin_of_text|> ids
<|end_of_text|>. A conversation is rendered by the tokenizer's encode_chat (the bytes that
generate.py --chat writes) and gets a loss mask in which only the assistant messages' content and
their <|eot_id|> count. Every val_every-th document (the first, then every N-th) goes to the
validation split. Documents are read lazily, encoded in chunks on a pool of processes (results in
input order, so the output does not depend on the number of workers), and each split is cut into
shards of exactly shard_tokens tokens (the last one shorter), written as they fill.

The shards are written into a folder of their own beside the dataset (.NAME.partial), and only a
preparation that finished moves them into place, then writes the dataset's manifest last
(llama/data/manifest.py): a failure, Ctrl-C or kill -9 leaves the dataset that was there (--overwrite)
as it was, and the data loader never takes an unfinished one for whole. An empty document is skipped
and named; so is, in chat data, a conversation with no assistant reply (nothing of it counts in the
loss), and chat data in which nothing counts at all is an error.
"""

from __future__ import annotations

import glob
import itertools
import json
import multiprocessing
import os
import shutil
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from ..runtime.progress import bar, choose_display
from .manifest import MANIFEST_SUFFIX, PARTIAL, manifest_path, write_manifest
from .shards import mask_path, write_mask, write_shard

INPUT_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
KINDS = "/".join(INPUT_SUFFIXES)
CHUNK_BYTES = 1 << 20  # input bytes per task of the pool
CHUNK_DOCUMENTS = 1024  # and at most this many documents


class PrepareError(ValueError):
    """Input that cannot become shards; the message is one line, naming the file and line."""


@dataclass(frozen=True)
class Record:
    """One document as read: a .txt file's bytes, a JSONL line's bytes, a .json array's item or a
    parquet cell's value."""
    source: str
    line: int  # 1-based line (JSONL), item (.json) or row (parquet); 0 for a whole .txt file
    kind: str  # "text", "json", "item" or "value"
    payload: bytes | str | dict | None

    def where(self) -> str:
        if self.kind in ("item", "value"):
            return f"{self.source}: record {self.line}"
        return f"{self.source}:{self.line}" if self.line else self.source


def expand_inputs(inputs: Iterable[str]) -> list[Path]:
    """The files that the inputs name: files as given, folders searched recursively and globs, each
    folder's and glob's files sorted; only .txt, .jsonl, .json and .parquet (not a dataset's manifest)."""
    def is_input(p: Path) -> bool:  # a dataset's manifest is no document
        return p.suffix in INPUT_SUFFIXES and p.is_file() and not p.name.endswith(MANIFEST_SUFFIX)

    paths: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if is_input(p))
        elif path.is_file():
            found = [path]
        else:
            found = sorted(Path(p) for p in glob.glob(item, recursive=True) if is_input(Path(p)))
            if not found:
                raise PrepareError(f"{item}: no such file, folder, or glob matching {KINDS} files")
        for p in found:
            if p.suffix not in INPUT_SUFFIXES:
                raise PrepareError(f"{p}: unknown input kind {p.suffix!r}; use {KINDS}")
        paths += found
    if not paths:
        raise PrepareError(f"no {KINDS} files in {' '.join(inputs)}")
    return paths


def _parquet_records(path: Path, text_field: str) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow)") from None
    file = pq.ParquetFile(path)
    if text_field not in file.schema_arrow.names:
        raise PrepareError(f"{path}: no column {text_field!r} (columns: {', '.join(file.schema_arrow.names)}); "
                           "choose one with --text-field")
    row = 0
    for batch in file.iter_batches(columns=[text_field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            row += 1
            yield Record(str(path), row, "value", value)


def json_error(e: json.JSONDecodeError) -> str:
    """What is wrong and where on its line: "Expecting value at column 9", "Unterminated string starting at column 3"."""
    return f"{e.msg}{'' if e.msg.endswith(' at') else ' at'} column {e.colno}"


def _json_array_records(path: Path) -> Iterator[Record]:
    try:
        items = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise PrepareError(f"{path}: not UTF-8 (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    except json.JSONDecodeError as e:
        raise PrepareError(f"{path}:{e.lineno}: invalid JSON ({json_error(e)})") from None
    if not isinstance(items, list):
        raise PrepareError(f"{path}: a .json input is an array of objects, not a {type(items).__name__}")
    for number, item in enumerate(items, 1):
        yield Record(str(path), number, "item", item)


def read_records(paths: Iterable[Path], text_field: str) -> Iterator[Record]:
    """Every document of the files, lazily, in order; blank JSONL lines are not documents."""
    for path in paths:
        if path.suffix == ".txt":
            yield Record(str(path), 0, "text", path.read_bytes())
        elif path.suffix == ".jsonl":
            with open(path, "rb") as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        yield Record(str(path), number, "json", line)
        elif path.suffix == ".json":
            yield from _json_array_records(path)
        else:
            yield from _parquet_records(path, text_field)


def is_conversation(record: Record) -> bool:
    """Whether a record is a JSON object with "messages" (bad JSON is left to the encoder to report)."""
    if record.kind == "item":
        return isinstance(record.payload, dict) and "messages" in record.payload
    if record.kind != "json":
        return False
    try:
        value = json.loads(record.payload)
    except ValueError:
        return False
    return isinstance(value, dict) and "messages" in value


@dataclass
class EncodedChunk:
    """The documents of a chunk of records, concatenated, and the records that could not be encoded."""
    tokens: np.ndarray  # uint32
    mask: np.ndarray | None  # uint8, chat data only
    lengths: list[int] = field(default_factory=list)  # tokens of each document, in order
    bad: list[str] = field(default_factory=list)  # "file:line: why" of each bad record, in order
    empty: list[str] = field(default_factory=list)  # where each document without text is, in order
    no_reply: list[str] = field(default_factory=list)  # where each conversation without an assistant reply is
    input_bytes: int = 0


class DocumentEncoder:
    """Records to framed token ids (and loss masks for chat); picklable, so each worker holds one."""

    def __init__(self, tokenizer, text_field: str = "text", chat: bool = False):
        if chat and not hasattr(tokenizer, "encode_chat"):
            raise PrepareError("chat data needs the Llama 3 tokenizer (--tokenizer PATH to tokenizer.model or "
                               "tokenizer.json); the byte-level tokenizer has no chat format")
        self.tokenizer, self.text_field, self.chat = tokenizer, text_field, chat

    def text_of(self, record: Record) -> str:
        """The document's text; PrepareError naming the file and line if there is none."""
        if record.kind == "text":
            try:
                return record.payload.decode("utf-8")
            except UnicodeDecodeError as e:
                line = record.payload.count(b"\n", 0, e.start) + 1
                raise PrepareError(f"{record.source}:{line}: not UTF-8 (byte {e.object[e.start]:#04x})") from None
        value = self.object_of(record) if record.kind != "value" else {self.text_field: record.payload}
        text = value.get(self.text_field)
        if not isinstance(text, str):
            what = "no" if text is None else f"a {type(text).__name__}, not a string, in the"
            raise PrepareError(f"{record.where()}: {what} {self.text_field!r} field (--text-field names it)")
        return text

    def object_of(self, record: Record) -> dict:
        """The JSON object of a JSONL line or a .json item."""
        if record.kind == "item":
            if not isinstance(record.payload, dict):
                raise PrepareError(f"{record.where()}: a JSON {type(record.payload).__name__}, not an object")
            return record.payload
        try:
            value = json.loads(record.payload.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise PrepareError(f"{record.where()}: not UTF-8 (byte {e.object[e.start]:#04x} at column "
                               f"{e.start + 1})") from None
        except json.JSONDecodeError as e:
            raise PrepareError(f"{record.where()}: invalid JSON ({json_error(e)})") from None
        if not isinstance(value, dict):
            raise PrepareError(f"{record.where()}: a JSON {type(value).__name__}, not an object")
        return value

    def conversation_of(self, record: Record) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask) of a conversation, without the framing EOS."""
        messages = self.object_of(record).get("messages") if record.kind in ("json", "item") else None
        if not isinstance(messages, list) or not messages:
            raise PrepareError(f"{record.where()}: no 'messages' list (the data is chat: its first document is one)")
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in CHAT_MASKED):
                raise PrepareError(f"{record.where()}: a message must be {{\"role\": system|user|assistant, "
                                   f"\"content\": string}}, got {json.dumps(m)[:80]}")
        return chat_tokens_and_mask(self.tokenizer, messages)

    def encode(self, record: Record) -> tuple[np.ndarray, np.ndarray | None]:
        """A record as <|begin_of_text|> ids <|end_of_text|>, and its loss mask for chat."""
        tok = self.tokenizer
        if self.chat:
            ids, mask = self.conversation_of(record)
            return np.append(ids, tok.eos_id).astype(np.uint32), np.append(mask, 0).astype(np.uint8)
        ids = tok.encode(self.text_of(record))
        return np.array([tok.bos_id, *ids, tok.eos_id], dtype=np.uint32), None

    def __call__(self, records: list[Record]) -> EncodedChunk:
        pieces, masks, chunk = [], [], EncodedChunk(np.zeros(0, np.uint32), None)
        for record in records:
            chunk.input_bytes += record_bytes(record)
            try:
                ids, mask = self.encode(record)
            except PrepareError as e:
                chunk.bad.append(str(e))
                continue
            if not self.chat and ids.size == 2:  # <|begin_of_text|> <|end_of_text|>: no text
                chunk.empty.append(record.where())
                continue
            if self.chat and not mask.any():
                chunk.no_reply.append(record.where())
            pieces.append(ids)
            masks.append(mask)
            chunk.lengths.append(ids.size)
        if pieces:
            chunk.tokens = np.concatenate(pieces)
        if self.chat:
            chunk.mask = np.concatenate(masks) if masks else np.zeros(0, np.uint8)
        return chunk


CHAT_MASKED = {"system": True, "user": True, "assistant": False}  # role -> left out of the loss


def chat_tokens_and_mask(tokenizer, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """A conversation exactly as encode_chat renders it (without the trailing assistant header that
    invites a reply), and a mask that is 1 on each assistant message's content and <|eot_id|>."""
    prompt_tail = len(tokenizer.encode_header("assistant"))
    ids, mask = [tokenizer.bos_id], [0]
    for message in messages:
        piece = tokenizer.encode_chat([message])[1:-prompt_tail]  # header, content, <|eot_id|>
        header = len(tokenizer.encode_header(message["role"]))
        counted = 0 if CHAT_MASKED[message["role"]] else 1
        ids += piece
        mask += [0] * header + [counted] * (len(piece) - header)
    return np.asarray(ids, np.uint32), np.asarray(mask, np.uint8)


def record_bytes(record: Record) -> int:
    """About the input bytes a record stands for (the progress bar's unit; a .json item: its strings)."""
    payload = record.payload
    if isinstance(payload, dict):
        return sum(len(v) for v in payload.values() if isinstance(v, str))
    if isinstance(payload, str):
        return len(payload.encode("utf-8"))
    return len(payload) if isinstance(payload, bytes) else 0


def chunked(records: Iterable[Record]) -> Iterator[list[Record]]:
    """Records in lists of about CHUNK_BYTES input bytes (at most CHUNK_DOCUMENTS records)."""
    chunk, size = [], 0
    for record in records:
        chunk.append(record)
        size += record_bytes(record)
        if size >= CHUNK_BYTES or len(chunk) >= CHUNK_DOCUMENTS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


_worker_encoder: DocumentEncoder | None = None


def _start_worker(encoder: DocumentEncoder) -> None:
    """A pool worker keeps its encoder and leaves Ctrl-C to the main process."""
    global _worker_encoder
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_encoder = encoder


def _encode_in_worker(records: list[Record]) -> EncodedChunk:
    return _worker_encoder(records)


def encode_chunks(records: Iterable[Record], encoder: DocumentEncoder, workers: int) -> Iterator[EncodedChunk]:
    """The records encoded chunk by chunk, in input order, on `workers` processes; at most two chunks
    per worker are in flight, so memory stays bounded whatever the corpus size."""
    if workers <= 1:
        yield from map(encoder, chunked(records))
        return
    with multiprocessing.get_context("fork").Pool(workers, _start_worker, (encoder,)) as pool:
        pending = deque()
        for chunk in chunked(records):
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class ShardWriter:
    """One split's shards, <name>_<split>_000000.bin on, in out_dir: each exactly shard_tokens tokens (the last
    one shorter), written as soon as it fills; with masks, each one's loss-mask sidecar is written first. Each
    shard's tokens (and counted tokens, with masks) are kept for the manifest."""

    def __init__(self, out_dir: Path, name: str, split: str, shard_tokens: int, vocab_size: int, with_mask: bool):
        self.prefix = out_dir / f"{name}_{split}_"
        self.shard_tokens, self.vocab_size, self.with_mask = shard_tokens, vocab_size, with_mask
        self.tokens: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.buffered = 0
        self.paths: list[Path] = []
        self.entries: list[dict] = []  # the manifest's entry of each shard
        self.documents = self.total_tokens = self.counted = 0

    def add(self, tokens: np.ndarray, mask: np.ndarray | None) -> None:
        """One or more documents' tokens (and mask)."""
        self.tokens.append(tokens)
        if self.with_mask:
            self.masks.append(mask)
        self.buffered += tokens.size
        self.total_tokens += tokens.size
        while self.buffered >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def close(self) -> list[Path]:
        """Writes the last, partial shard; the paths of all."""
        if self.buffered:
            self._flush(self.buffered)
        return self.paths

    def moved_to(self, out_dir: Path) -> None:
        """The shards were moved into out_dir: their paths from now on."""
        self.prefix = out_dir / self.prefix.name
        self.paths = [out_dir / p.name for p in self.paths]

    def _flush(self, count: int) -> None:
        tokens = np.concatenate(self.tokens)
        path = Path(f"{self.prefix}{len(self.paths):06d}.bin")
        entry = {"file": path.name, "tokens": count}
        if self.with_mask:
            mask = np.concatenate(self.masks)
            write_mask(mask_path(path), mask[:count])
            entry["counted"] = int(mask[:count].sum(dtype=np.int64))
            self.counted += entry["counted"]
            self.masks = [mask[count:].copy()]
        write_shard(path, tokens[:count], self.vocab_size, listed=True)
        self.tokens, self.buffered = [tokens[count:].copy()], self.buffered - count  # not a view of it all
        self.paths.append(path)
        self.entries.append(entry)


def existing_shards(out_dir: Path, name: str) -> list[Path]:
    """Shards (and sidecars) of a dataset of this name already in out_dir, and its manifest."""
    found = sorted(p for split in ("train", "val") for p in out_dir.glob(f"{glob.escape(name)}_{split}_*.bin"))
    return found + [manifest_path(out_dir, name)] * manifest_path(out_dir, name).exists()


@dataclass(frozen=True)
class PrepareOptions:
    name: str  # the dataset's name, the shards' prefix
    out_dir: Path
    text_field: str = "text"
    shard_tokens: int = 100_000_000  # as llm.c's FineWeb shards
    val_every: int = 100  # every N-th document is validation (the first, then every N-th); 0: none
    workers: int = 1
    skip_bad: bool = False  # count and skip bad records instead of stopping at the first
    overwrite: bool = False  # replace shards of the same name in out_dir


@dataclass
class Summary:
    writers: dict[str, ShardWriter]
    chat: bool
    skipped: int = 0
    seconds: float = 0.0
    empty: list[str] = field(default_factory=list)  # where the documents without text were
    no_reply: list[str] = field(default_factory=list)  # where the conversations without an assistant reply were

    def lines(self) -> list[str]:
        train, val = self.writers["train"], self.writers["val"]
        tokens = train.total_tokens + val.total_tokens
        rate = tokens / self.seconds if self.seconds else 0.0
        out = [f"documents: {train.documents + val.documents:,} ({train.documents:,} train, {val.documents:,} val)"
               f"{', conversations with loss masks' if self.chat else ''}",
               f"tokens: {tokens:,} ({train.total_tokens:,} train, {val.total_tokens:,} val)",
               f"shards: {len(train.paths)} train, {len(val.paths)} val, in {train.prefix.parent}",
               f"time: {self.seconds:.1f} s, {rate:,.0f} tokens/s"]
        if self.chat:
            out.append(f"counted in the loss: {train.counted + val.counted:,} tokens (the assistant's replies)")
        if self.skipped:
            out.append(f"skipped: {self.skipped:,} bad records (--skip-bad)")
        if self.empty:
            out.append(f"skipped: {len(self.empty):,} empty documents ({first_ones(self.empty)})")
        if self.no_reply:
            out.append(f"conversations without an assistant reply, of which nothing counts in the loss: "
                       f"{len(self.no_reply):,} ({first_ones(self.no_reply)})")
        return out

    def manifest(self, name: str, tokenizer) -> dict:
        """The dataset's manifest (llama/data/manifest.py)."""
        return {"name": name, "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "chat": self.chat,
                "documents": {split: w.documents for split, w in self.writers.items()},
                "splits": {split: w.entries for split, w in self.writers.items()}}


def first_ones(places: list[str], shown: int = 3) -> str:
    return ", ".join(places[:shown]) + (", ..." if len(places) > shown else "")


class Progress:
    """A bar of input bytes on the terminal a person watches; else (a pipe, a file) a line every
    `every` seconds with the elapsed time."""

    def __init__(self, total_bytes: int | None, every: float = 10.0):
        self.lines = choose_display().step_lines
        self.bar = bar(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing")
        self.start = self.last = time.perf_counter()
        self.every, self.total, self.done, self.documents, self.tokens = every, total_bytes, 0, 0, 0

    def update(self, chunk: EncodedChunk) -> None:
        self.done += chunk.input_bytes
        self.documents += len(chunk.lengths)
        self.tokens += chunk.tokens.size
        self.bar.update(chunk.input_bytes)
        now = time.perf_counter()
        if self.lines and now - self.last >= self.every:
            self.last = now
            of = f" of {self.total / 1e6:,.1f}" if self.total else ""
            print(f"tokenizing: {self.done / 1e6:,.1f}{of} MB, {self.documents:,} documents, {self.tokens:,} tokens, "
                  f"{now - self.start:.0f} s", flush=True)

    def close(self) -> None:
        self.bar.close()


def _split_documents(chunk: EncodedChunk, first_index: int, val_every: int, writers: dict[str, ShardWriter]) -> None:
    """Each document of the chunk to its split's writer; document first_index + i is the chunk's i-th."""
    offset = 0
    for i, length in enumerate(chunk.lengths):
        writer = writers["val" if val_every and (first_index + i) % val_every == 0 else "train"]
        mask = chunk.mask[offset:offset + length] if chunk.mask is not None else None
        writer.add(chunk.tokens[offset:offset + length], mask)
        writer.documents += 1
        offset += length


def _check_out_dir(options: PrepareOptions) -> list[Path]:
    """The files of the dataset of the same name to replace (with overwrite), else an error if there are any."""
    if not options.name or options.name in (".", "..") or "/" in options.name or os.sep in options.name:
        raise PrepareError(f"--name {options.name!r} is the shards' file name prefix, not a path: choose a plain "
                           "name, and the folder with --out-dir")
    if options.out_dir.exists() and not options.out_dir.is_dir():
        raise PrepareError(f"{options.out_dir} is a file; choose a folder with --out-dir")
    old = existing_shards(options.out_dir, options.name)
    if old and not options.overwrite:
        raise PrepareError(f"{options.out_dir} already holds {options.name}'s shards ({old[0].name}, ...); "
                           "pass --overwrite to replace them, or choose another --name or --out-dir")
    return old


def prepare_dataset(inputs: Iterable[str], tokenizer, options: PrepareOptions) -> Summary:
    """Tokenize the inputs into <name>_train_*.bin and <name>_val_*.bin in out_dir, with the manifest last. They
    are written into out_dir/.<name>.partial first and moved into place once whole: on any error or Ctrl-C (or a
    kill) out_dir is left as it was, the dataset there too, and folders made for it are removed."""
    paths = expand_inputs(inputs)
    old = _check_out_dir(options)
    records = read_records(paths, options.text_field)
    first = next(records, None)
    if first is None:
        raise PrepareError(f"no documents in {' '.join(map(str, paths))}")
    chat = is_conversation(first)
    encoder = DocumentEncoder(tokenizer, options.text_field, chat)
    made = [p for p in (options.out_dir, *options.out_dir.parents) if not p.exists()]
    partial = options.out_dir / PARTIAL.format(name=options.name)
    try:
        options.out_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # a killed preparation's
        partial.mkdir()
        summary = _write_shards(itertools.chain([first], records), encoder, partial, tokenizer, options, chat,
                                None if any(p.suffix == ".parquet" for p in paths) else
                                sum(p.stat().st_size for p in paths))
        write_manifest(manifest_path(partial, options.name), summary.manifest(options.name, tokenizer))
        _move_into_place(partial, options.out_dir, old, summary)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        for folder in made:  # deepest first: those made for this dataset, while empty
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    return summary


def _write_shards(records: Iterable[Record], encoder: DocumentEncoder, folder: Path, tokenizer,
                  options: PrepareOptions, chat: bool, total_bytes: int | None) -> Summary:
    """The records encoded into both splits' shards in folder; PrepareError where they make no dataset."""
    writers = {split: ShardWriter(folder, options.name, split, options.shard_tokens, tokenizer.vocab_size, chat)
               for split in ("train", "val")}
    summary = Summary(writers, chat)
    progress, start = Progress(total_bytes), time.perf_counter()
    try:
        for chunk in encode_chunks(records, encoder, options.workers):
            if chunk.bad and not options.skip_bad:
                raise PrepareError(chunk.bad[0])
            summary.skipped += len(chunk.bad)
            summary.empty += chunk.empty
            summary.no_reply += chunk.no_reply
            _split_documents(chunk, writers["train"].documents + writers["val"].documents, options.val_every, writers)
            progress.update(chunk)
        for writer in writers.values():
            writer.close()
    finally:
        progress.close()
    if not writers["train"].documents and not writers["val"].documents and summary.empty:
        raise PrepareError(f"no text in the inputs: every document is empty ({first_ones(summary.empty)})")
    if not writers["train"].documents:
        raise PrepareError("no training documents: the validation split took them all (--val-every 0 for "
                           "no validation split)")
    if chat and not writers["train"].counted:
        raise PrepareError("no training conversation has an assistant reply, so nothing would count in --sft's loss "
                           f"({first_ones(summary.no_reply)}); a conversation needs a message "
                           '{"role": "assistant", "content": ...} to learn from')
    summary.seconds = time.perf_counter() - start
    return summary


def _move_into_place(partial: Path, out_dir: Path, old: list[Path], summary: Summary) -> None:
    """The finished dataset from partial into out_dir: the old one's manifest goes first (from then on the loader
    refuses what is left of it), the new shards move in over the old ones, the old ones left are removed, and the
    new manifest comes last."""
    manifest = next(partial.glob("*.manifest.json"))
    for path in old:
        if path.name == manifest.name:
            path.unlink()
    moved = set()
    for path in sorted(partial.iterdir()):
        if path != manifest:
            os.replace(path, out_dir / path.name)
            moved.add(path.name)
    for path in old:
        if path.name not in moved and path.name != manifest.name:
            path.unlink()
    os.replace(manifest, out_dir / manifest.name)
    partial.rmdir()
    for writer in summary.writers.values():
        writer.moved_to(out_dir)
