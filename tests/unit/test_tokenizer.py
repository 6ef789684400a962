import io
import json
from pathlib import Path

import pytest

from llama.data import tokenizer as tok
from llama.model.generate import TextStream
from tests.runs import run
from tests.sample_files import ranks_file_bytes


@pytest.fixture
def llama3(tmp_path):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(ranks_file_bytes())  # 256 bytes + 5 merges, in the real file's format
    return tok.Llama3Tokenizer(path)


def test_round_trip_and_merges(llama3):
    text = "the thin line: ünïcödé, 日本語, emoji 🦙\r\n  tabs\tand 12345"
    ids = llama3.encode(text)
    assert llama3.decode(ids) == text
    assert llama3.encode("the") == [257]
    assert llama3.encode_bytes(text.encode() + b"\xff").tolist() == llama3.encode(text + "\ufffd")
    assert llama3.encode(" the") == [258]


def test_special_tokens(llama3):
    n = 261
    assert llama3.vocab_size == n + 256
    assert (llama3.bos_id, llama3.eos_id) == (n, n + 1)
    s = llama3.special_tokens
    assert s["<|eot_id|>"] == n + 9 and s["<|python_tag|>"] == n + 10
    assert s["<|reserved_special_token_2|>"] == n + 11 and s["<|reserved_special_token_246|>"] == n + 255
    assert llama3.encode("hi", bos=True)[0] == n
    assert llama3.decode([n, 104, 105, n + 9]) == "<|begin_of_text|>hi<|eot_id|>"
    # special-token text inside a document is plain text, never a control token
    assert n not in llama3.encode("<|begin_of_text|>")


def test_real_id_layout():
    specials = tok.llama3_special_tokens()
    assert len(specials) == 256 and len(set(specials)) == 256
    assert specials[:2] == ["<|begin_of_text|>", "<|end_of_text|>"]
    assert specials[9] == "<|eot_id|>"  # 128009 in the real vocabulary


def test_byte_tokenizer_round_trip():
    b = tok.ByteTokenizer()
    text = "plain ascii, ünïcödé, 🦙, \x00 nul"
    assert b.decode(b.encode(text)) == text
    assert b.encode("a", bos=True) == [256, 97]
    raw = bytes(range(256)) + b"\xff\xfe\xc3"  # invalid UTF-8 too
    ids = b.encode_bytes(raw)
    assert ids.tolist() == list(raw)
    assert bytes(int(i) for i in ids) == raw
    assert b.decode([104, 256, 105, 257]) == "h<|begin_of_text|>i<|end_of_text|>"
    assert b.decode([0xff, 104]) == "\ufffdh"


def test_load_tokenizer(tmp_path, capsys):
    assert isinstance(tok.load_tokenizer(), tok.ByteTokenizer)  # the test's own cache is empty
    assert "byte-level tokenizer" in capsys.readouterr().err
    with pytest.raises(tok.TokenizerError, match="not found"):
        tok.load_tokenizer(tmp_path / "missing.model")
    default = tok.default_tokenizer_path()
    default.parent.mkdir(parents=True)
    default.write_bytes(ranks_file_bytes())
    assert tok.load_tokenizer().vocab_size == 517


def test_chat_encoding_follows_meta_format(llama3):
    # ids of the test vocabulary: 261 <|begin_of_text|>, 267 <|start_header_id|>, 268 <|end_header_id|>,
    # 270 <|eot_id|>; merges th 256, the 257, in 260; other ids are bytes
    messages = [{"role": "system", "content": "the thin line"}, {"role": "user", "content": "hi"}]
    assert llama3.encode_chat(messages) == [
        261,
        267, 115, 121, 115, 116, 101, 109, 268, 10, 10,  # system header, "\n\n"
        257, 32, 256, 260, 32, 108, 260, 101, 270,  # "the" " th|in" " l|in|e" <|eot_id|>
        267, 117, 115, 101, 114, 268, 10, 10,  # user header
        104, 105, 270,  # "hi" <|eot_id|>
        267, 97, 115, 115, 105, 115, 116, 97, 110, 116, 268, 10, 10,  # assistant header, for the reply
    ]
    assert llama3.encode_header("tool")[1:-3] == llama3.encode("ipython")
    assert llama3.stop_ids == (262, 269, 270)
    with pytest.raises(ValueError, match="unknown chat role 'robot'"):
        llama3.encode_chat([{"role": "robot", "content": "x"}])


REAL_TOKENIZER = tok.default_tokenizer_path()  # read at collection, before the tests' own caches: the user's


@pytest.mark.skipif(not REAL_TOKENIZER.exists(), reason="Meta's tokenizer.model is not in the user's cache")
def test_real_tokenizer_matches_meta_tests():
    """The token ids of llama-models' own tokenizer tests (llama3/tests/api/test_tokenizer.py)."""
    real = tok.Llama3Tokenizer(REAL_TOKENIZER)
    assert real.vocab_size == 128256
    sentence = [2028, 374, 264, 1296, 11914, 13]
    assert real.encode("This is a test sentence.", bos=True) == [128000, *sentence]
    assert real.encode_chat([{"role": "system", "content": "This is a test sentence."},
                             {"role": "user", "content": "This is a response."}]) == [
        128000, 128006, 9125, 128007, 271, *sentence, 128009,
        128006, 882, 128007, 271, 2028, 374, 264, 2077, 13, 128009,
        128006, 78191, 128007, 271]


def test_token_bytes_for_streaming(llama3):
    ids = llama3.encode("日本 the")
    assert b"".join(llama3.token_bytes(i) for i in ids) == "日本 the".encode()
    assert llama3.token_bytes(llama3.eot_id) == b"<|eot_id|>"
    b = tok.ByteTokenizer()
    assert b.token_bytes(0xe6) == b"\xe6" and b.token_bytes(257) == b"<|end_of_text|>"


def test_reserved_byte_ids_decode_to_nothing():
    """A byte-level model can sample the reserved ids 258..263: streaming and decoding skip them."""
    b = tok.ByteTokenizer()
    reserved = list(range(258, b.vocab_size))
    out = io.StringIO()
    stream = TextStream(b, out)
    for i in [104, *reserved, 105]:
        stream(i)
    assert out.getvalue() == "hi" and b.decode([104, *reserved, 105]) == "hi"
    assert all(b.token_bytes(i) == b"" for i in reserved)


def test_hf_tokenizer_json_round_trip(llama3, tmp_path):
    files = tok.hf_tokenizer_files(llama3, model_max_length=64)
    model = files["tokenizer.json"]["model"]
    assert model["merges"] == [["t", "h"], ["th", "e"], ["Ġ", "the"], ["l", "l"], ["i", "n"]]
    assert model["vocab"]["Ġthe"] == 258 and model["vocab"]["Ċ"] == 10  # GPT-2's byte alphabet
    added = files["tokenizer.json"]["added_tokens"]
    assert len(added) == 256 and added[9] == {**added[9], "id": 270, "content": "<|eot_id|>"}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(files["tokenizer.json"]))
    again = tok.Llama3Tokenizer(path)
    assert again.ranks == llama3.ranks and again.vocab_size == llama3.vocab_size
    text = "the thin line: ünïcödé 日本語 🦙\r\n  tabs\tand 12345"
    assert again.encode(text) == llama3.encode(text)


def test_tokenizer_json_that_is_not_llama3(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"model": {"type": "WordPiece", "vocab": {}}, "pre_tokenizer": None}))
    with pytest.raises(tok.TokenizerError, match="is not a Llama 3 tokenizer"):
        tok.Llama3Tokenizer(path)
    path.write_text("{")
    with pytest.raises(tok.TokenizerError, match="is not a tokenizer.json \\(not JSON text\\)"):
        tok.Llama3Tokenizer(path)


def test_hf_tokenizers_library_encodes_the_same(llama3):
    tokenizers = pytest.importorskip("tokenizers")
    files = tok.hf_tokenizer_files(llama3, model_max_length=64)
    hf = tokenizers.Tokenizer.from_str(json.dumps(files["tokenizer.json"]))
    for text in ["the thin line: ünïcödé 日本語 🦙\r\n  tabs\tand 12345", "  the  the\n\n\nthe", "ll in the, thin."]:
        ids = llama3.encode(text, bos=True)
        assert hf.encode(text).ids == ids
        assert hf.decode(ids, skip_special_tokens=False) == llama3.decode(ids)


def test_a_replaced_file_at_the_same_path_is_read_again(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = Path("tokenizer") / "tokenizer.model"  # relative, as a user may pass it
    path.parent.mkdir(parents=True)
    path.write_bytes(ranks_file_bytes())
    assert tok.Llama3Tokenizer(path).vocab_size == 517
    path.write_bytes(ranks_file_bytes().rsplit(b"\n", 2)[0] + b"\n")  # one merge fewer
    assert tok.Llama3Tokenizer(path).vocab_size == 516


@pytest.mark.parametrize("contents, expected", [
    ("# llama-cuda\n\nLlama 3.1 training\n", "README.md is not a tokenizer: line 1 is not a base64 token and its rank"),
    ("{not json", "README.md is not a tokenizer.json (not JSON text)"),
    ('{"model": {"type": "Unigram"}}', "README.md is not a Llama 3 tokenizer"),
])
def test_a_file_that_is_not_a_tokenizer_is_one_line_saying_what_was_expected(tmp_path, monkeypatch, contents,
                                                                              expected, capsys):
    """Issue 49: --tokenizer README.md said "invalid literal for int() with base 10"."""
    monkeypatch.chdir(tmp_path)
    name = "README.md" if contents.startswith("#") else "README.md.json"
    Path(name).write_text(contents)
    assert run("-e", "tiny", "-x", "1", "--tokenizer", name, "-o", "out") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {expected.replace('README.md', name, 1)}") and "\n" not in err, err
    assert "tokenizer.model (one base64 token and its rank a line) or a Hugging Face tokenizer.json" in err \
        or "Llama 3 tokenizer (byte-level BPE" in err
    assert not (tmp_path / "out").exists()
