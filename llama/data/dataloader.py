"""A streaming, resumable data loader over token shards.

Each shard of N tokens is cut into (N - 1) // T rows: row r is tokens [r*T, r*T + T + 1), inputs
its first T and targets its last T. Rows are taken in global batches of B * world_size rows, and
rank r gets rows [r*B, (r+1)*B) of each; rows left over at the end of a shard are skipped. With
shuffle on, every epoch visits the shards and each shard's rows in an order drawn from
(seed, epoch), so the state (epoch, shard, batch) is all a checkpoint needs to resume exactly.
Only the current shard is open, as a memmap: memory does not grow with the dataset. A shard's
loss-mask sidecar (name.mask.bin, written for chat data) is never taken for a shard; with_mask=True
returns its rows beside the targets. Every shard's header, and the manifest of a prepared dataset
(llama/data/manifest.py), are checked when the loader is made, before the first step; check_masks() does
the same for the sidecars.
"""

from __future__ import annotations

import glob
from pathlib import Path

import numpy as np

from ..runtime.progress import phase
from .manifest import MANIFEST_SUFFIX, check_listed, unfinished
from .prepare import INPUT_SUFFIXES
from .shards import ShardError, check_mask, is_mask_sidecar, mask_path, open_mask, open_shard, read_header

PREPARE = "python3 scripts/prepare_data.py"


class DataLoader:
    def __init__(self, pattern: str, B: int, T: int, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, seed: int = 0, vocab_size: int | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.pattern, self.files = str(pattern), shard_files(str(pattern))
        self.B, self.T, self.rank, self.world_size = B, T, rank, world_size
        self.shuffle, self.seed, self.vocab_size = shuffle, seed, vocab_size
        rows_per_batch = B * world_size
        headers = [read_header(f) for f in self.files]
        self.listed = check_listed(headers)  # {shard: its manifest entry} of a prepared dataset's shards
        for h in headers:
            if vocab_size is not None and h.vocab_size and h.vocab_size != vocab_size:
                raise ShardError(f"{h.path}: written by a tokenizer with vocab {h.vocab_size}, "
                                 f"but the model's vocab is {vocab_size}")
        self.num_tokens = [h.num_tokens for h in headers]
        self.batches_per_shard = [max(0, (h.num_tokens - 1) // T) // rows_per_batch for h in headers]
        if sum(self.batches_per_shard) == 0:
            largest = max(self.num_tokens)
            raise ShardError(f"{pattern}: a step reads {rows_per_batch} rows of {T + 1} tokens from one shard, and the "
                             f"largest of its {len(headers)} shard(s) holds {largest:,} tokens ({(largest - 1) // T} "
                             f"such rows; {sum(self.num_tokens):,} tokens in all): lower -b or -t, or prepare more "
                             "data")
        self.epoch, self.shard_pos, self.batch_pos = 0, 0, 0
        self._open = None  # ((epoch, shard index), tokens, row order, loss mask or None) of the shard in use

    @property
    def batches_per_epoch(self) -> int:
        return sum(self.batches_per_shard)

    def _shard_order(self) -> np.ndarray:
        order = np.arange(len(self.files))
        if self.shuffle:
            np.random.default_rng([self.seed, self.epoch]).shuffle(order)
        return order

    def _row_order(self, shard: int, num_rows: int) -> np.ndarray:
        order = np.arange(num_rows)
        if self.shuffle:
            np.random.default_rng([self.seed, self.epoch, shard]).shuffle(order)
        return order

    def _skip_empty_shards(self) -> None:
        while True:
            if self.shard_pos == len(self.files):
                self.epoch, self.shard_pos = self.epoch + 1, 0
            shard = int(self._shard_order()[self.shard_pos])
            if self.batch_pos < self.batches_per_shard[shard]:
                return
            self.shard_pos, self.batch_pos = self.shard_pos + 1, 0

    def next_batch(self, with_mask: bool = False) -> tuple[np.ndarray, ...]:
        """(inputs, targets), each (B, T) int32; with_mask, also the (B, T) uint8 loss mask of the targets
        (1 where a target counts), read from the shard's sidecar."""
        self._skip_empty_shards()
        shard = int(self._shard_order()[self.shard_pos])
        key = (self.epoch, shard)
        if self._open is None or self._open[0] != key or (with_mask and self._open[3] is None):
            tokens = open_shard(self.files[shard], self.vocab_size)
            num_rows = self.batches_per_shard[shard] * self.B * self.world_size
            mask = self._open_mask(shard, tokens.size) if with_mask else None
            self._open = (key, tokens, self._row_order(shard, num_rows), mask)
        _, tokens, rows, mask = self._open
        first = (self.batch_pos * self.world_size + self.rank) * self.B
        starts = rows[first:first + self.B] * self.T
        windows = np.stack([tokens[s:s + self.T + 1] for s in starts]).astype(np.int32)
        self.batch_pos += 1
        if not with_mask:
            return windows[:, :-1], windows[:, 1:]
        masks = np.stack([mask[s + 1:s + self.T + 1] for s in starts])
        return windows[:, :-1], windows[:, 1:], masks

    def _open_mask(self, shard: int, num_tokens: int) -> np.ndarray:
        return open_mask(self._mask_of(self.files[shard]), num_tokens)

    @staticmethod
    def _mask_of(shard: str) -> Path:
        """The loss-mask sidecar of a shard, which must exist (else a ShardError naming the shard)."""
        path = mask_path(shard)
        if not path.exists():
            raise ShardError(f"{shard} has no loss mask ({path.name}); chat data written by "
                             "scripts/prepare_data.py has one")
        return path

    def check_masks(self) -> None:
        """Every shard has its loss-mask sidecar (with_mask reads them), of the shard's length: else a ShardError
        naming the first that has none or a wrong one, before any batch is read."""
        for shard, num_tokens in zip(self.files, self.num_tokens):
            check_mask(self._mask_of(shard), num_tokens)

    def has_masks(self) -> bool:
        """Whether any shard has a loss-mask sidecar (chat data, meant for --sft)."""
        return any(mask_path(shard).exists() for shard in self.files)

    def describe(self) -> str:
        """The shards in a few words: "data/x/x_train_*.bin (3 shards, 1,234,567 tokens)"."""
        return f"{self.pattern} ({len(self.files)} shard{'s' * (len(self.files) > 1)}, {sum(self.num_tokens):,} tokens)"

    def holds_token(self, token: int, within: int = 1 << 22) -> bool:
        """Whether the first shard's first `within` tokens hold `token` (a document's start, for the mask)."""
        tokens = open_shard(self.files[0])
        return bool((tokens[:within] == token).any())

    def counted_tokens(self) -> int:
        """The tokens the loss masks count, over every shard: from a prepared dataset's manifest, else read from
        the sidecars (after check_masks)."""
        total = 0
        with phase("counting the tokens of the loss masks", total=sum(self.num_tokens), unit="tok") as progress:
            for shard, num_tokens in zip(self.files, self.num_tokens):
                entry = self.listed.get(Path(shard))
                if entry is not None and "counted" in entry:
                    total += entry["counted"]
                else:
                    total += int(open_mask(mask_path(shard), num_tokens).sum(dtype=np.int64))
                progress.update(num_tokens)
        return total

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "shard_pos": self.shard_pos, "batch_pos": self.batch_pos, "seed": self.seed,
                "files": [Path(f).name for f in self.files], "B": self.B, "T": self.T, "rank": self.rank,
                "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved position; the state may come from another rank or world size, as long as
        the rows of a global batch (B * world_size) are the same."""
        mine = self.state_dict() | {"rows_per_batch": self.B * self.world_size}
        state = state | {"rows_per_batch": state["B"] * state["world_size"]}
        for key in ("seed", "files", "T", "rows_per_batch"):
            if state[key] != mine[key]:
                raise ValueError(f"data loader state does not fit this loader: {key} was {state[key]!r}, "
                                 f"is {mine[key]!r}")
        self.epoch, self.shard_pos, self.batch_pos = state["epoch"], state["shard_pos"], state["batch_pos"]
        self._open = None

    def reset(self) -> None:
        """Back to the first batch of epoch 0 (for a fixed validation pass)."""
        self.epoch, self.shard_pos, self.batch_pos = 0, 0, 0


def shard_files(pattern: str) -> list[str]:
    """The token shards a pattern (a glob or a file) names, sorted, without loss-mask sidecars; a ShardError that
    says what was named instead, and what to run, when they are not shards."""
    matched = sorted(glob.glob(pattern))
    files = [f for f in matched if not is_mask_sidecar(f)]
    for f in files:
        path = Path(f)
        if path.is_dir():
            raise ShardError(f"{f} is a folder: name its shards with a glob, e.g. -i '{path / '*_train_*.bin'}'")
        if f.endswith(MANIFEST_SUFFIX):
            raise ShardError(f"{f} is a dataset's manifest, not a shard: pass the shards it lists, e.g. "
                             f"-i '{f.removesuffix(MANIFEST_SUFFIX)}_train_*.bin'")
        if path.suffix in INPUT_SUFFIXES:
            raise ShardError(f"{f} is a {path.suffix} file, not token shards: tokenize it first with {PREPARE} {f} "
                             "and pass the shards it writes")
    if files:
        return files
    if matched:
        shards = sorted({f.removesuffix(".mask.bin") + ".bin" for f in matched})
        raise ShardError(f"{pattern} names loss-mask sidecars only ({Path(matched[0]).name}, ...), which go with "
                         f"their shards: pass the shards, e.g. -i '{shards[0]}', with --sft for chat data")
    left = unfinished(Path(pattern).parent)
    if left:
        raise ShardError(f"no shard files match {pattern}; {left[0]} holds a preparation that did not finish "
                         f"(stopped or killed): run {PREPARE} again")
    raise ShardError(f"no shard files match {pattern}")
