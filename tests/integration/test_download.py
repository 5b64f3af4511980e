"""Multi30k download against a local HTTP server on 127.0.0.1 (no test reaches the internet):
fetch, sha256 check, temp-file-then-rename, cache reuse, and the errors."""

from __future__ import annotations

import gzip
import hashlib
import shutil

import pytest
from test_fetch import Server  # tests/integration is on sys.path

from aiayn.data import corpus as corpus_mod
from aiayn.data.corpus import download_file, load_dataset
from aiayn.errors import DataError


@pytest.fixture
def served(tmp_path):
    folder = tmp_path / "www" / "raw"
    folder.mkdir(parents=True)
    with Server(folder) as server:
        yield folder, server


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_download_verifies_and_caches(served, tmp_path):
    folder, server = served
    data = gzip.compress(b"A man.\nTwo dogs.\n")
    (folder / "f.gz").write_bytes(data)
    target = tmp_path / "cache" / "f.gz"
    assert download_file(server.url + "f.gz", target, sha(data)) == target
    assert target.read_bytes() == data
    assert list(target.parent.iterdir()) == [target]  # no temp file left
    download_file(server.url + "f.gz", target, sha(data))
    assert [path for path, _ in server.requests] == ["/f.gz"]  # the second used the cache
    target.write_bytes(b"corrupted")
    download_file(server.url + "f.gz", target, sha(data))
    assert target.read_bytes() == data and len(server.requests) == 2


def test_checksum_mismatch_leaves_nothing(served, tmp_path):
    folder, server = served
    (folder / "f.gz").write_bytes(b"tampered")
    target = tmp_path / "cache" / "f.gz"
    with pytest.raises(DataError, match=f"sha256 {sha(b'tampered')}, expected {'0' * 64}"):
        download_file(server.url + "f.gz", target, "0" * 64)
    assert list(target.parent.iterdir()) == []


def test_unreachable_file_names_url_and_way_out(served, tmp_path):
    _, server = served
    with pytest.raises(DataError, match=f"cannot download {server.url}missing.gz .*"
                                        "AIAYN_DATA_DIR"):
        download_file(server.url + "missing.gz", tmp_path / "c" / "missing.gz", "0" * 64)
    assert list((tmp_path / "c").iterdir()) == []


def test_load_multi30k_by_download(served, tmp_path, monkeypatch):
    """The named dataset, with AIAYN_DATA_DIR unset: files the test makes, their sums set in
    the table the code checks against."""
    folder, server = served
    files = {"val.en.gz": b" A man.\nTwo dogs.\n", "val.de.gz": b"Ein Mann.\nZwei Hunde. \n"}
    for name, text in files.items():
        (folder / name).write_bytes(gzip.compress(text))
        monkeypatch.setitem(corpus_mod.MULTI30K_SHA256, name, sha((folder / name).read_bytes()))
    monkeypatch.delenv("AIAYN_DATA_DIR", raising=False)
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("AIAYN_MULTI30K_URL", server.url)
    c = load_dataset("multi30k", "val", "en", "de")
    assert (c.src, c.tgt) == (["A man.", "Two dogs."], ["Ein Mann.", "Zwei Hunde."])
    assert sorted(p.name for p in (tmp_path / "cache" / "multi30k").iterdir()) == sorted(files)
    n = len(server.requests)
    assert load_dataset("multi30k", "val", "de", "en").src == ["Ein Mann.", "Zwei Hunde."]
    assert len(server.requests) == n  # from the cache
    # the base URL may also be passed as an argument
    shutil.rmtree(tmp_path / "cache")
    monkeypatch.delenv("AIAYN_MULTI30K_URL")
    assert len(load_dataset("multi30k", "val", "en", "de", base_url=server.url)) == 2


def test_real_multi30k_checksums(served, data_dir, tmp_path, monkeypatch):
    """Serve copies of the real files: the shipped sha256 table accepts them byte for byte."""
    folder, server = served
    for lang in ("en", "de"):
        shutil.copy(data_dir / "multi30k" / f"val.{lang}.gz", folder)
    monkeypatch.delenv("AIAYN_DATA_DIR", raising=False)
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path / "cache"))
    c = load_dataset("multi30k", "val", "en", "de", base_url=server.url)
    assert len(c) == 1014
    (folder / "val.en.gz").write_bytes(gzip.compress(b"not multi30k\n"))
    (tmp_path / "cache" / "multi30k" / "val.en.gz").unlink()
    with pytest.raises(DataError, match="val.en.gz: downloaded file has sha256"):
        load_dataset("multi30k", "val", "en", "de", base_url=server.url)
