"""The Llama 3 tokenizer from a llama-models wheel: a wheel file on disk, and pip against a local
package index (no network). The wheels are made here, holding the small ranks file of the tests."""

import base64
import hashlib
import zipfile

import pytest

from llama.data import starter_pack
from llama.data import tokenizer as tok
from llama.data import tokenizer_fetch as tf
from llama.data.shards import read_header
from tests.httpserver import Route, Server
from tests.sample_files import SHAKESPEARE, ranks_file_bytes

MODEL = ranks_file_bytes()
WHEEL_NAME = "llama_models-0.3.0-py3-none-any.whl"


def make_wheel(path, model: bytes | None = MODEL):
    """A minimal wheel of llama-models 0.3.0 (pip reads its METADATA and WHEEL)."""
    files = {"llama_models-0.3.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: llama_models\nVersion: 0.3.0\n",
             "llama_models-0.3.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
             "llama_models/__init__.py": b""}
    if model is not None:
        files[tf.WHEEL_MEMBER] = model
    record = "".join(f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for name, data in files.items())
    files["llama_models-0.3.0.dist-info/RECORD"] = (record + "llama_models-0.3.0.dist-info/RECORD,,\n").encode()
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


@pytest.fixture
def small_model(monkeypatch):
    """The fetch expects the test ranks file instead of Meta's."""
    monkeypatch.setattr(tf, "LLAMA3_TOKENIZER", {"size": len(MODEL), "sha256": hashlib.sha256(MODEL).hexdigest()})


@pytest.fixture
def index(small_model, tmp_path):
    """A package index on 127.0.0.1 serving the wheel, as pip's simple API (PEP 503) does."""
    wheel = make_wheel(tmp_path / WHEEL_NAME).read_bytes()
    server = Server()
    page = (f'<html><body><a href="/files/{WHEEL_NAME}#sha256={hashlib.sha256(wheel).hexdigest()}">'
            f'{WHEEL_NAME}</a></body></html>').encode()
    server.routes["/simple/llama-models/"] = Route(page, content_type="text/html")
    server.routes[f"/files/{WHEEL_NAME}"] = Route(wheel, content_type="application/octet-stream")
    yield server
    server.close()


def test_wheel_file_on_disk(small_model, tmp_path):
    dest = tf.fetch_llama3_tokenizer(tmp_path / "tok" / "tokenizer.model", wheel=make_wheel(tmp_path / WHEEL_NAME))
    assert dest.read_bytes() == MODEL
    assert tok.Llama3Tokenizer(dest).vocab_size == 517
    assert [p.name for p in dest.parent.iterdir()] == ["tokenizer.model"]


def test_wrong_or_missing_file_in_the_wheel(small_model, tmp_path):
    dest = tmp_path / "tok" / "tokenizer.model"
    with pytest.raises(tf.FetchError, match="does not match the Llama 3 tokenizer"):
        tf.fetch_llama3_tokenizer(dest, wheel=make_wheel(tmp_path / "a.whl", MODEL + b"x"))
    with pytest.raises(tf.FetchError, match="holds no llama_models/llama3/tokenizer.model"):
        tf.fetch_llama3_tokenizer(dest, wheel=make_wheel(tmp_path / "b.whl", None))
    with pytest.raises(tf.FetchError, match="wheel not found"):
        tf.fetch_llama3_tokenizer(dest, wheel=tmp_path / "missing.whl")
    assert not dest.parent.exists() or list(dest.parent.iterdir()) == []


def test_pip_downloads_the_wheel_from_an_index(index, tmp_path):
    dest = tf.fetch_llama3_tokenizer(tmp_path / "tokenizer.model", index_url=index.url + "/simple/", retries=0)
    assert dest.read_bytes() == MODEL
    assert len(index.routes[f"/files/{WHEEL_NAME}"].requests) == 1
    tf.fetch_llama3_tokenizer(dest, index_url=index.url + "/simple/")  # verified: nothing fetched again
    assert len(index.routes[f"/files/{WHEEL_NAME}"].requests) == 1


def test_unreachable_index_fails_in_one_line(small_model, tmp_path):
    with pytest.raises(tf.FetchError, match="could not download llama-models==0.3.0.*reachable") as e:
        tf.fetch_llama3_tokenizer(tmp_path / "tokenizer.model", retries=0, timeout=2)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "tokenizer.model").exists()


@pytest.mark.slow
def test_load_tokenizer_fetches_or_falls_back_to_bytes(index, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert isinstance(tok.load_tokenizer(fetch=True), tok.ByteTokenizer)  # the default index is unreachable
    err = capsys.readouterr().err
    assert "fetching it from Meta's llama-models wheel" in err and "byte-level tokenizer" in err
    monkeypatch.setattr(tf, "INDEX_URL", index.url + "/simple/")
    assert tok.load_tokenizer(fetch=True).vocab_size == 517
    assert tok.default_tokenizer_path().read_bytes() == MODEL


def test_starter_pack_gets_the_tokenizer_from_the_wheel(index, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    text = SHAKESPEARE.encode()
    monkeypatch.setattr(starter_pack, "TINYSHAKESPEARE", {**starter_pack.TINYSHAKESPEARE, "size": len(text),
                                                          "sha256": hashlib.sha256(text).hexdigest()})
    index.routes["/" + starter_pack.TINYSHAKESPEARE["path"]] = Route(text)
    args = ["--base-url", index.url, "--dest", str(tmp_path / "data"), "--retries", "0"]
    assert starter_pack.main([*args, "--index-url", index.url + "/simple/"]) == 0
    assert read_header(tmp_path / "data" / "tinyshakespeare" / "tiny_shakespeare_train.bin").vocab_size == 517
    # a wheel on disk works without any index
    make_wheel(tmp_path / WHEEL_NAME)
    assert starter_pack.main([*args, "--dest", str(tmp_path / "data2"), "--tokenizer-wheel",
                              str(tmp_path / WHEEL_NAME)]) == 0
    assert (tmp_path / "data2" / "tokenizer" / "tokenizer.model").read_bytes() == MODEL


def test_starter_pack_stops_on_an_unusable_wheel(tmp_path, capsys):
    """A wheel given by hand that holds no usable tokenizer is an error, not a quiet fall back to bytes."""
    (tmp_path / "garbage.whl").write_bytes(b"not a zip file")
    assert starter_pack.main(["--dest", str(tmp_path / "data"), "--base-url", "http://127.0.0.1:9", "--retries", "0",
                              "--tokenizer-wheel", str(tmp_path / "garbage.whl")]) == 1
    wheel = tmp_path / "garbage.whl"
    assert capsys.readouterr().err.strip() == f"error: cannot read wheel {wheel}: File is not a zip file"
    assert not (tmp_path / "data" / "tinyshakespeare").exists()
