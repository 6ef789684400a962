"""The read-ahead of a checkpoint's files (llama/io/read_ahead.py, the one-GPU --resume): it reads the ranges in
order, never more than `ahead` bytes beyond what the reader consumed, stops on close() and on a failed read,
and stream_checkpoint tells it every byte it consumed."""

import time

import numpy as np

from llama.io.checkpoint import checkpoint_ranges, load_checkpoint, stream_checkpoint
from llama.io.read_ahead import ReadAhead

from tests.unit.test_checkpoint_stream import saved

PIECE = 4096


def settled(read_ahead: ReadAhead, expected: int, seconds: float = 5.0) -> int:
    """read_ahead.read_bytes once it reached expected (or after seconds), and a moment later still."""
    deadline = time.monotonic() + seconds
    while read_ahead.read_bytes < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # a thread that would read past the limit has had the time to
    return read_ahead.read_bytes


def files(tmp_path, sizes):
    paths = []
    for i, size in enumerate(sizes):
        paths.append(tmp_path / f"file{i}")
        paths[-1].write_bytes(np.random.default_rng(i).integers(0, 256, size, np.uint8).tobytes())
    return paths


def test_it_stays_within_ahead_of_the_reader_and_reads_everything_once_consumed(tmp_path):
    a, b = files(tmp_path, [10 * PIECE + 100, 5 * PIECE])
    ranges = [(a, 100, 10 * PIECE), (b, 0, 5 * PIECE)]
    with ReadAhead(ranges, ahead=3 * PIECE, threads=2, piece=PIECE) as read_ahead:
        assert len(read_ahead.pieces) == 15
        assert settled(read_ahead, 3 * PIECE) == 3 * PIECE
        read_ahead.consumed(PIECE + 1)  # into the second piece: the fifth may start (it begins 3 pieces on)
        assert settled(read_ahead, 5 * PIECE) == 5 * PIECE
        read_ahead.consumed(15 * PIECE)
        assert settled(read_ahead, 15 * PIECE) == 15 * PIECE
    assert read_ahead.fds == {}


def test_close_stops_the_threads_waiting_for_the_reader(tmp_path):
    (a,) = files(tmp_path, [8 * PIECE])
    read_ahead = ReadAhead([(a, 0, 8 * PIECE)], ahead=PIECE, threads=3, piece=PIECE)
    assert settled(read_ahead, PIECE) == PIECE
    read_ahead.close()
    assert not any(thread.is_alive() for thread in read_ahead.threads)


def test_a_failed_read_stops_it_quietly(tmp_path):
    (a,) = files(tmp_path, [2 * PIECE])
    read_ahead = ReadAhead([(a, 0, 6 * PIECE)], ahead=10 * PIECE, threads=1, piece=PIECE)  # past the file's end
    for thread in read_ahead.threads:
        thread.join(5)
    assert read_ahead.stopped and read_ahead.read_bytes == 2 * PIECE
    read_ahead.close()


def test_stream_checkpoint_tells_it_every_byte_consumed(tmp_path):
    lazy = load_checkpoint(saved(tmp_path, quantized=True), read=False)
    ranges = checkpoint_ranges(lazy)
    total = sum(n for _, _, n in ranges)
    with ReadAhead(ranges, ahead=PIECE, threads=2, piece=PIECE) as read_ahead:
        stream_checkpoint(lazy, [np.zeros(5000, np.uint8) for _ in range(2)], lambda *part: None,
                          read_ahead=read_ahead)
        assert read_ahead.done == total
        assert settled(read_ahead, total) == total
