"""The flash attention launchers reject bad shapes, dtypes and alignment before touching the device
(so this runs without a GPU: the arrays are descriptors of no memory)."""

import re
from pathlib import Path

import numpy as np
import pytest

from llama import ops
from llama.runtime.cuda import BF16, DeviceArray

B, T, H, KV, D = 2, 10, 4, 2, 64


def fake(shape, dtype=BF16, ptr=256):
    return DeviceArray(ptr, shape, dtype, None)


def forward_args(**changes):
    args = {"out": fake((B, T, H * D)), "lse": fake((B, H, T), np.float32), "qkv": fake((B, T, (H + 2 * KV) * D)),
            "n_heads": H, "n_kv_heads": KV, "source": ops.FlashSource()}
    return args | changes


def backward_args(**changes):
    args = {"dqkv": fake((B, T, (H + 2 * KV) * D)), "scratch": fake((B * H * T,), np.float32),
            "dout": fake((B, T, H * D))} | forward_args()
    del args["n_heads"], args["n_kv_heads"]
    return args | {"n_heads": H, "n_kv_heads": KV} | changes


@pytest.mark.parametrize("changes, message", [
    ({"n_kv_heads": 3}, "4 query heads cannot share 3 kv heads"),
    ({"qkv": fake((B, T, (H + 2 * KV) * D), np.float32)}, "qkv: expected a bf16"),
    ({"qkv": fake((B, T, (H + 2 * KV) * 32))}, "D 64 or 128"),
    ({"qkv": fake((B, 0, (H + 2 * KV) * D))}, "T >= 1"),
    ({"out": fake((B, T, H * D), np.float32)}, "out: expected bfloat16"),
    ({"lse": fake((B, T, H), np.float32)}, "lse: expected float32 \\(2, 4, 10\\)"),
    ({"out": fake((B, T, H * D), ptr=258)}, "out: .* 16-byte aligned"),
])
def test_forward_rejects(changes, message):
    with pytest.raises(ValueError, match=message):
        ops.flash_attention_forward(**forward_args(**changes))


@pytest.mark.parametrize("changes, message", [
    ({"dqkv": fake((B, T, (H + 2 * KV) * D), np.float32)}, "dqkv: expected bfloat16"),
    ({"dout": fake((B, T + 1, H * D))}, "dout: expected"),
    ({"scratch": fake((B * H * T,))}, "scratch: expected float32"),
    ({"cos": fake((T, D // 2), np.float32)}, "cos and sin"),
    ({"cos": fake((T - 1, D // 2), np.float32), "sin": fake((T - 1, D // 2), np.float32)}, "cos: expected"),
    ({"cos": fake((T, D // 2), np.float32), "sin": fake((T, D), np.float32)}, "sin: expected"),
])
def test_backward_rejects(changes, message):
    with pytest.raises(ValueError, match=message):
        ops.flash_attention_backward(**backward_args(**changes))


@pytest.mark.parametrize("source, persistent, T, grid, batch", [
    (ops.FlashSource(), False, 10, (H, B, 1), ()),  # mma.sync: a CTA per (head, batch, query tile), no batch count
    (ops.FlashSource("flash_attention_wgmma", tma=True), False, 10, (H, B, 1), (B,)),  # wgmma: the same grid
    (ops.FlashSource("flash_attention_wgmma", tma=True), True, 10, (H * B, 1, 1), (B,)),  # fewer items (8) than SMs
    (ops.FlashSource("flash_attention_wgmma", tma=True), True, 5000, (132, 1, 1), (B,)),  # 320 items: a CTA per SM
])
def test_forward_grid(monkeypatch, source, persistent, T, grid, batch):
    """The forward's launch: a grid of query tiles, or where the build's table says its forward is persistent at
    this head dim one CTA per SM (at most one per work item); a wgmma build takes the batch count after KV, since a
    persistent grid does not carry it."""
    from llama.ops import flash_attention as launcher
    launches = []
    monkeypatch.setattr(launcher, "kernel", lambda module, name, signature, directory: (
        lambda grid, threads, *args, shared: launches.append((signature, grid, args))))
    monkeypatch.setattr(launcher, "flash_config",
                        lambda source, D, which: launcher._FlashLaunch(384, 128, 1024, persistent))
    monkeypatch.setattr(launcher, "_tma_maps", lambda qkv: (4096,))
    monkeypatch.setattr(launcher, "multiprocessors", lambda: 132)
    args = forward_args(out=fake((B, T, H * D)), lse=fake((B, H, T), np.float32), qkv=fake((B, T, (H + 2 * KV) * D)),
                        source=source)
    ops.flash_attention_forward(**args)
    [(signature, launched, values)] = launches
    maps = (4096,) if source.tma else ()
    assert launched == grid
    assert signature == "P" * len(maps) + "PPPiii" + "i" * len(batch) + "PP"
    assert values == (*maps, 256, 256, 256, T, H, KV, *batch, 0, 0)


class _Table:
    """A stand-in for the runtime that flash_config reads a module's launch table from."""

    def __init__(self, table):
        self.table = table
        self.drv = self

    def module(self, name, directory, entry):
        assert entry.startswith("flash_attention_forward_d")  # a unit that every use of the file loads
        return self

    def get_global(self, name):
        assert name == "flash_attention_config"
        return 0, self.table.nbytes

    def memcpy_dtoh(self, out, pointer):
        out[...] = self.table


def test_flash_config_reads_the_named_columns(monkeypatch):
    """Each kernel's (threads, rows, shared bytes) and the forward's persistence come from the columns every build's
    table has: forward 0-2, dkdv 3-5, dq 6-8, persistence 9."""
    from llama.ops import flash_attention as launcher
    columns = 10
    table = np.arange(100, 100 + 2 * columns, dtype=np.int32).reshape(2, columns)
    table[:, 9] = [1, 0]  # persistent at D = 64 only
    monkeypatch.setattr(launcher, "runtime", lambda: _Table(table))
    monkeypatch.setattr(launcher, "_FLASH_CONFIGS", {})
    source = ops.FlashSource(f"flash_attention_test_{columns}")
    config = lambda D, which: launcher.flash_config(source, D, which)  # noqa: E731
    assert config(64, "forward") == launcher._FlashLaunch(100, 101, 102, True)
    assert config(128, "forward") == launcher._FlashLaunch(100 + columns, 101 + columns, 102 + columns, False)
    assert config(64, "dkdv") == launcher._FlashLaunch(103, 104, 105)
    assert config(64, "dq") == launcher._FlashLaunch(106, 107, 108)


def top_level_values(row: str) -> int:
    """How many comma-separated values a C initializer row holds, commas inside <...> and (...) not counted."""
    depth, count = 0, 1
    for c in row:
        depth += c in "<("
        depth -= c in ">)"
        count += c == "," and depth == 0
    return count


def launch_table(path: Path, table: str = "flash_attention_config") -> tuple[int, list[str]]:
    """The declared width of a .cu file's launch table (int name[2][width]) and its two rows' text."""
    declared = re.search(rf"int {table}\[2\]\[(\d+)\] = \{{(.*?)\n\}};", path.read_text(), re.S)
    return int(declared.group(1)), re.findall(r"\{([^{}]*)\}", declared.group(2))


@pytest.mark.parametrize("path", ["kernels/flash_attention.cu", "kernels/flash_attention_wgmma.cu"])
def test_every_launch_table_fills_the_columns_the_launcher_reads(path):
    """A row one value short would leave the last column 0 (C fills it silently): each build's table declares the
    width flash_config reads and both rows (D = 64, 128) give every value."""
    width, rows = launch_table(Path(__file__).resolve().parents[2] / path)
    assert width == 10  # forward, dkdv and dq (three columns each), then the forward's persistence
    assert len(rows) == 2 and all(top_level_values(row) == width for row in rows)
