import pytest

from llama import tokenizer as tok
from tests.test_download import ranks_file_bytes


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


def test_load_tokenizer(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert isinstance(tok.load_tokenizer(), tok.ByteTokenizer)
    assert "byte-level tokenizer" in capsys.readouterr().err
    with pytest.raises(tok.TokenizerError, match="not found"):
        tok.load_tokenizer(tmp_path / "missing.model")
    bad = tmp_path / "bad.model"
    bad.write_text("not base64 at all\n")
    with pytest.raises(tok.TokenizerError, match="cannot read"):
        tok.load_tokenizer(bad)
    default = tmp_path / tok.DEFAULT_TOKENIZER_PATH
    default.parent.mkdir(parents=True)
    default.write_bytes(ranks_file_bytes())
    assert tok.load_tokenizer().vocab_size == 517
