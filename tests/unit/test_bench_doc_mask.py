"""scripts/bench_doc_mask.py's pure parts (the benchmark itself runs on the device): the packed rows' documents
and BOS tokens, the work the mask leaves, the error measure, the tables, the --rows argument, and the one error
line where torch has no flex_attention."""

import argparse
import sys
import types

import numpy as np
import pytest

from llama.twins.attention import document_ids
from scripts import bench_doc_mask as bench


def test_a_row_is_covered_by_documents_of_the_chosen_lengths_cut_at_the_rows_ends():
    rng = np.random.default_rng(3)
    for _ in range(50):
        segments, _ = bench.packed_row(8192, rng, shortest=200, longest=3000)
        assert segments[0][0] == 0 and segments[-1][1] == 8192
        assert all(end == start for (_, end), (start, _) in zip(segments, segments[1:]))  # contiguous
        assert all(200 <= end - start <= 3000 for start, end in segments[1:-1])  # whole documents
        assert all(1 <= end - start <= 3000 for start, end in (segments[0], segments[-1]))  # cut by the row


def test_the_first_document_begins_inside_the_row_or_before_it():
    flags = [bench.packed_row(1000, np.random.default_rng(seed), shortest=1, longest=3)[1] for seed in range(60)]
    assert any(flags) and not all(flags)


def test_bos_tokens_mark_exactly_the_documents_the_row_was_packed_with():
    tokens, rows = bench.packed_rows(3, 8192, seed=5)
    assert tokens.dtype == np.int32 and tokens.shape == (3, 8192)
    ids = document_ids(tokens, bench.BOS_ID)  # the oracle's reading of the rows
    for b, segments in enumerate(rows):
        bos = np.flatnonzero(tokens[b] == bench.BOS_ID).tolist()
        assert bos == [s for s, _ in segments if s > 0 or tokens[b, 0] == bench.BOS_ID]
        assert [len(set(ids[b, s:e].tolist())) for s, e in segments] == [1] * len(segments)
        assert len({int(ids[b, s]) for s, _ in segments}) == len(segments)
    assert (tokens[tokens != bench.BOS_ID] < bench.BOS_ID).all()


def test_rows_are_seeded():
    a, b, c = bench.packed_rows(2, 4096, seed=1), bench.packed_rows(2, 4096, seed=1), bench.packed_rows(2, 4096, seed=2)
    assert np.array_equal(a[0], b[0]) and a[1] == b[1]
    assert a[1] != c[1]


def test_document_flops_count_each_documents_causal_half():
    rows = [[(0, 10), (10, 30)], [(0, 5)]]
    assert bench.document_flops(rows, n_heads=2, head_dim=4) == 2 * 2 * 4 * (10 ** 2 + 20 ** 2 + 5 ** 2)


def test_the_error_is_over_the_references_largest_magnitude():
    want = np.array([[4.0, -8.0], [1e-9, 0.0]])
    got = want + np.array([[0.0, 0.2], [1e-3, 0.0]])
    assert bench.max_relative_error(got, want) == pytest.approx(0.2 / 8.0)  # not 1e-3 / 1e-9
    assert bench.relative_errors({"out": got, "dq": want}, {"out": want, "dq": want}) == \
        {"out": pytest.approx(0.025), "dq": 0.0}


def test_the_error_table_has_a_row_per_comparison():
    case = bench.Case(1, 8192, 64, 6, "flash v2 (mma.sync)")
    text = bench.error_table([(case, "ours vs flex", {"out": 1e-3, "dq": 2e-3, "dk": 3e-3, "dv": 4.5e-3})])
    header, rule, row = text.splitlines()
    assert header == "| B x T | D | docs | build | compared | out | dq | dk | dv |"
    assert rule.count("---") == 9
    assert row == ("| 1 x 8192 | 64 | 6 | flash v2 (mma.sync) | ours vs flex | 1.00e-03 | 2.00e-03 | 3.00e-03 "
                   "| 4.50e-03 |")


def test_the_speed_table_gives_each_others_time_over_ours_and_our_tflops():
    case = bench.Case(2, 8192, 128, 11, "flash v6 (wgmma + TMA)")
    ms = {"ours": {"fwd_ms": 0.5, "bwd_ms": 1.0, "fwdbwd_ms": 1.5},
          "flex": {"fwd_ms": 1.0, "bwd_ms": 1.5, "fwdbwd_ms": 3.0},
          "sdpa_doc": {"fwd_ms": 2.0, "bwd_ms": 4.0, "fwdbwd_ms": 6.0},
          "unmasked": {"fwd_ms": 1.25, "bwd_ms": 3.0, "fwdbwd_ms": 4.5},
          "sdpa_row": {"fwd_ms": 3.0, "bwd_ms": 6.0, "fwdbwd_ms": 9.0, "memory": 0}}
    lines = bench.speed_table([(case, ms, 10 ** 12)]).splitlines()
    assert len(lines) == 2 + 3
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert cells[0][4:] == ["pass", "ours ms", "flex ms", "SDPA/doc ms", "unmasked ms", "SDPA row ms", "vs flex",
                            "vs SDPA/doc", "vs unmasked", "ours TFLOP/s"]
    assert cells[2][:4] == ["2 x 8192", "128", "11", "flash v6 (wgmma + TMA)"]
    assert cells[2][4:] == ["fwd", "0.500", "1.000", "2.000", "1.250", "3.000", "2.00x", "4.00x", "2.50x", "2000"]
    assert cells[3][4] == "bwd" and cells[3][-4:] == ["1.50x", "4.00x", "3.00x", "2500"]  # 2.5x the forward's FLOPs
    assert cells[4][4] == "fwd+bwd" and cells[4][-1] == f"{3.5e12 / 1.5 / 1e9:.0f}"


def test_rows_argument():
    assert bench.parse_rows("2x8192") == (2, 8192) and bench.parse_rows("1X16384") == (1, 16384)
    for bad in ("8192", "0x8192", "axb", "1x2x3"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_rows(bad)


def test_a_torch_without_flex_attention_is_one_error_line(monkeypatch, capsys):
    old_torch = types.ModuleType("torch")
    old_torch.__version__ = "2.4.1"
    monkeypatch.setitem(sys.modules, "torch", old_torch)
    for name in ("torch.nn", "torch.nn.attention", "torch.nn.attention.flex_attention"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    with pytest.raises(SystemExit) as stop:
        bench.compiled_flex()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: scripts/bench_doc_mask.py needs torch.nn.attention.flex_attention (torch >= 2.5), "
                          "which this torch 2.4.1 lacks") and "pip install -U torch" in err
