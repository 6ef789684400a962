import errno
import hashlib

import numpy as np
import pytest

import llama.data.download as dl
from llama.data import starter_pack
from llama.data.shards import read_header
from tests.httpserver import Route, Server
from tests.sample_files import SHAKESPEARE, ranks_file_bytes

BODY = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
SHA = hashlib.sha256(BODY).hexdigest()
FAST = dict(retries=3, backoff=0.01, timeout=5.0, progress=False)


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


def test_complete_file_and_rerun_skips(server, tmp_path):
    route = server.routes["/f.bin"] = Route(BODY)
    dest = dl.download(server.url + "/f.bin", tmp_path / "f.bin", size=len(BODY), sha256=SHA, **FAST)
    assert dest.read_bytes() == BODY
    assert not (tmp_path / "f.bin.part").exists()
    dl.download(server.url + "/f.bin", dest, size=len(BODY), sha256=SHA, **FAST)
    assert len(route.requests) == 1  # the verified file was not fetched again


def test_dropped_connection_resumes_to_identical_file(server, tmp_path):
    route = server.routes["/f.bin"] = Route(BODY, drop_first_after=100_000)
    dest = dl.download(server.url + "/f.bin", tmp_path / "f.bin", size=len(BODY), sha256=SHA, **FAST)
    assert dest.read_bytes() == BODY
    assert route.requests[0] is None and route.requests[1].startswith("bytes=")
    assert int(route.requests[1].split("=")[1].rstrip("-")) > 0


def test_server_ignoring_range_restarts_from_zero(server, tmp_path):
    server.routes["/f.bin"] = Route(BODY, honor_range=False)
    (tmp_path / "f.bin.part").write_bytes(b"x" * 5000)  # a stale partial download
    dest = dl.download(server.url + "/f.bin", tmp_path / "f.bin", size=len(BODY), sha256=SHA, **FAST)
    assert dest.read_bytes() == BODY


def test_5xx_is_retried(server, tmp_path):
    route = server.routes["/f.bin"] = Route(BODY, fail_first=2)
    assert dl.download(server.url + "/f.bin", tmp_path / "f.bin", **FAST).read_bytes() == BODY
    assert len(route.requests) == 3


def test_401_explains_gated_model(server, tmp_path):
    server.routes["/f.bin"] = Route(status=401)
    with pytest.raises(dl.DownloadError, match="access refused.*accept the license"):
        dl.download(server.url + "/f.bin", tmp_path / "f.bin", gated=True, **FAST)
    assert not (tmp_path / "f.bin").exists()


def test_404(server, tmp_path):
    with pytest.raises(dl.DownloadError, match="not found"):
        dl.download(server.url + "/nothing", tmp_path / "f.bin", **FAST)


def test_checksum_mismatch_leaves_no_file(server, tmp_path):
    server.routes["/f.bin"] = Route(BODY)
    with pytest.raises(dl.DownloadError, match="does not match"):
        dl.download(server.url + "/f.bin", tmp_path / "f.bin", sha256="0" * 64, **FAST)
    assert list(tmp_path.iterdir()) == []


def test_stale_oversized_part_is_discarded(server, tmp_path):
    route = server.routes["/f.bin"] = Route(BODY)
    (tmp_path / "f.bin.part").write_bytes(BODY + b"left over from something else")
    dest = dl.download(server.url + "/f.bin", tmp_path / "f.bin", size=len(BODY), sha256=SHA, **FAST)
    assert dest.read_bytes() == BODY and route.requests == [None]


def test_stale_part_of_another_version_starts_over(server, tmp_path):
    route = server.routes["/f.bin"] = Route(BODY)
    (tmp_path / "f.bin.part").write_bytes(b"an older version of the file")
    dest = dl.download(server.url + "/f.bin", tmp_path / "f.bin", size=len(BODY), sha256=SHA, **FAST)
    assert dest.read_bytes() == BODY and route.requests == ["bytes=28-", None]


def test_file_failing_verification_never_stays_under_its_final_name(server, tmp_path):
    server.routes["/f.bin"] = Route(BODY, fail_first=100)  # and the server is down
    (tmp_path / "f.bin").write_bytes(bytes(len(BODY)))  # right size, wrong content
    with pytest.raises(dl.DownloadError, match="giving up after 2 tries"):
        dl.download(server.url + "/f.bin", tmp_path / "f.bin", size=len(BODY), sha256=SHA, **{**FAST, "retries": 1})
    assert not (tmp_path / "f.bin").exists()


def no_retries(monkeypatch):
    def sleep(seconds):
        raise AssertionError(f"retried after {seconds} s")
    monkeypatch.setattr(dl.time, "sleep", sleep)


def test_connection_refused_fails_at_once(tmp_path, monkeypatch):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    no_retries(monkeypatch)
    with pytest.raises(dl.DownloadError, match="Connection refused. Offline\\? Check the network connection"):
        dl.download(f"http://127.0.0.1:{port}/f.bin", tmp_path / "f.bin", progress=False)
    assert not (tmp_path / "f.bin").exists()


def test_dns_failure_fails_at_once(tmp_path, monkeypatch):
    import socket

    def no_dns(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    no_retries(monkeypatch)
    with pytest.raises(dl.DownloadError, match="Failed to resolve 'data.example'.*Offline\\?"):
        dl.download("https://data.example/f.bin", tmp_path / "f.bin", progress=False)


def test_disk_full(server, tmp_path, monkeypatch):
    server.routes["/f.bin"] = Route(BODY)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dl, "open", full_disk, raising=False)
    with pytest.raises(dl.DownloadError, match="disk full"):
        dl.download(server.url + "/f.bin", tmp_path / "f.bin", **FAST)
    assert not (tmp_path / "f.bin").exists()


# ---- the starter pack against a local mirror


@pytest.fixture
def mirror(server, monkeypatch):
    model = ranks_file_bytes()
    text = SHAKESPEARE.encode()
    monkeypatch.setattr(starter_pack, "TOKENIZER", {**starter_pack.TOKENIZER, "size": len(model),
                                                    "sha256": hashlib.sha256(model).hexdigest()})
    monkeypatch.setattr(starter_pack, "TINYSHAKESPEARE", {**starter_pack.TINYSHAKESPEARE, "size": len(text),
                                                          "sha256": hashlib.sha256(text).hexdigest()})
    server.routes["/" + starter_pack.TOKENIZER["path"]] = Route(model)
    server.routes["/" + starter_pack.TINYSHAKESPEARE["path"]] = Route(text)
    return server


def run_pack(mirror, tmp_path, *extra):
    return starter_pack.main(["--base-url", mirror.url, "--dest", str(tmp_path), "--retries", "1", *extra])


def test_starter_pack_without_any_tokenizer_uses_byte_tokenizer(mirror, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert run_pack(mirror, tmp_path) == 0  # the package index is unreachable in the tests
    err = capsys.readouterr().err
    assert "could not get the Llama 3 tokenizer from the llama-models wheel" in err and "--hf-token" in err
    assert read_header(tmp_path / "tinyshakespeare" / "tiny_shakespeare_train.bin").vocab_size == 264
    assert not (tmp_path / "tokenizer" / "tokenizer.model").exists()


def test_starter_pack_with_token(mirror, tmp_path):
    assert run_pack(mirror, tmp_path, "--hf-token", "hf_test") == 0
    route = mirror.routes["/" + starter_pack.TOKENIZER["path"]]
    assert route.requests == [None]
    val = read_header(tmp_path / "tinyshakespeare" / "tiny_shakespeare_val.bin")
    assert val.vocab_size == 261 + 256 and val.num_tokens == 32768


def test_starter_pack_refused_token(mirror, tmp_path, capsys):
    mirror.routes["/" + starter_pack.TOKENIZER["path"]].status = 403
    assert run_pack(mirror, tmp_path, "--hf-token", "hf_bad") == 1
    err = capsys.readouterr().err
    assert "access refused (403)" in err and "HF_TOKEN" in err
    assert not (tmp_path / "tokenizer" / "tokenizer.model").exists()


@pytest.mark.slow
def test_tinyshakespeare_is_verified_by_sha256(server, tmp_path, capsys, monkeypatch):
    """A right-size file with the wrong content (here not even UTF-8) is deleted, on every run."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    spec = starter_pack.TINYSHAKESPEARE
    server.routes["/" + spec["path"]] = Route(b"\xff" * spec["size"])
    for _ in range(2):
        assert run_pack(server, tmp_path) == 1
        assert "downloaded file does not match" in capsys.readouterr().err
        assert not (tmp_path / "tinyshakespeare" / "input.txt").exists()
        assert not (tmp_path / "tinyshakespeare" / "input.txt.part").exists()
    assert spec["size"] == 1_115_394
    assert spec["sha256"] == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


def test_starter_pack_without_dest_fills_the_per_user_cache(mirror, tmp_path, monkeypatch):
    """Issue 63 item 7: README's command has no --dest; it ended in a TypeError."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("LLAMA_CUDA_CACHE", str(tmp_path / "cache"))
    assert starter_pack.main(["--base-url", mirror.url, "--retries", "1"]) == 0
    assert read_header(tmp_path / "cache" / "tinyshakespeare" / "tiny_shakespeare_train.bin").num_tokens > 0
