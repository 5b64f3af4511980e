"""Corpus readers: aligned files, TSV, named datasets, and every kind of bad input."""

from __future__ import annotations

import gzip

import pytest

from aiayn.data.corpus import (
    load_dataset,
    load_files,
    load_parallel,
    load_tsv,
    multi30k_paths,
    read_lines,
)
from aiayn.errors import DataError


def write(path, data: bytes):
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_read_lines_strips_and_keeps_alignment(tmp_path, suffix):
    # \u2028 and \x0c are line breaks to str.splitlines but not to a line-aligned corpus
    data = " A man.\r\n\tEin Mann \nx\u2028y\x0cz\n\nlast without newline".encode()
    p = write(tmp_path / f"f.txt{suffix}", data)
    assert read_lines(p) == ["A man.", "Ein Mann", "x\u2028y\x0cz", "", "last without newline"]


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_invalid_utf8_names_file_and_line(tmp_path, suffix):
    p = write(tmp_path / f"bad.en{suffix}", b"fine\nalso fine\ncaf\xe9 latin-1\n")
    with pytest.raises(DataError, match=rf"{p}, line 3: invalid UTF-8"):
        read_lines(p)


def test_broken_gzip_is_a_data_error(tmp_path):
    p = tmp_path / "cut.en.gz"
    p.write_bytes(gzip.compress(b"one\ntwo\n" * 1000)[:50])
    with pytest.raises(DataError, match=f"{p}: read failed"):
        read_lines(p)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"file not found: {tmp_path / 'no.en'}"):
        load_parallel(tmp_path / "no.en", tmp_path / "no.de")


def test_line_count_mismatch_names_both_files_and_counts(tmp_path):
    a = write(tmp_path / "a.en", b"1\n2\n3\n")
    b = write(tmp_path / "b.de.gz", b"1\n2\n")
    with pytest.raises(DataError, match=f"{a} has 3 lines but {b} has 2"):
        load_parallel(a, b)


def test_empty_lines_dropped_with_count_or_kept_aligned(tmp_path):
    a = write(tmp_path / "a.en", b"one\n\nthree\nfour\n  \n")
    b = write(tmp_path / "b.de", b"eins\nzwei\n\nvier\n \n")
    dropped = load_parallel(a, b)
    assert (dropped.src, dropped.tgt, dropped.dropped_empty) == (["one", "four"],
                                                                 ["eins", "vier"], 3)
    assert "3 pairs with an empty side dropped" in dropped.describe()
    kept = load_parallel(a, b, drop_empty=False)
    assert kept.src == ["one", "", "three", "four", ""]
    assert kept.tgt == ["eins", "zwei", "", "vier", ""]
    assert kept.dropped_empty == 0


def test_tsv(tmp_path):
    p = write(tmp_path / "pairs.tsv.gz", b"a man\tein Mann \n\n dogs\tHunde\nsolo\t\n")
    c = load_tsv(p)
    assert (c.src, c.tgt, c.dropped_empty) == (["a man", "dogs"], ["ein Mann", "Hunde"], 2)
    r = load_files(p, None, drop_empty=False)
    assert (r.src, r.tgt) == (["a man", "", "dogs", "solo"], ["ein Mann", "", "Hunde", ""])
    assert load_tsv(p, reverse=True).src == ["ein Mann", "Hunde"]


def test_tsv_line_without_one_tab(tmp_path):
    p = write(tmp_path / "pairs.tsv", b"a\tb\nno tab here\n")
    with pytest.raises(DataError, match=rf"{p}, line 2: expected source<TAB>target, found 0 "):
        load_tsv(p)
    p = write(tmp_path / "pairs2.tsv", b"a\tb\tc\n")
    with pytest.raises(DataError, match=rf"{p}, line 1: .* found 2 tabs"):
        load_tsv(p)


# --- named datasets ---------------------------------------------------------------------------
def test_unknown_names(monkeypatch, tmp_path):
    monkeypatch.setenv("AIAYN_DATA_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="unknown dataset 'iwslt'; known: multi30k, wmt14-en-de"):
        load_dataset("iwslt", "train", "en", "de")
    with pytest.raises(ValueError, match="unknown Multi30k split 'test'"):
        load_dataset("multi30k", "test", "en", "de")
    with pytest.raises(ValueError, match="Multi30k has no language 'ru'"):
        load_dataset("multi30k", "train", "en", "ru")
    with pytest.raises(ValueError, match="wmt14-en-de has no training data"):
        load_dataset("wmt14-en-de", "train", "en", "de")


def test_missing_dataset_says_where_and_how(monkeypatch, tmp_path):
    monkeypatch.setenv("AIAYN_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError) as err:
        load_dataset("multi30k", "val", "en", "de")
    msg = str(err.value)
    assert str(tmp_path / "multi30k" / "val.en.gz") in msg
    assert "github.com/multi30k/dataset" in msg and "unset AIAYN_DATA_DIR" in msg
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "wmt14-en-de" / "newstest2014.en")):
        load_dataset("wmt14-en-de", "test", "en", "de")
    monkeypatch.delenv("AIAYN_DATA_DIR")
    with pytest.raises(FileNotFoundError, match="set AIAYN_DATA_DIR to a folder holding wmt14"):
        load_dataset("wmt14-en-de", "test", "en", "de")
    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="downloading is off"):
        multi30k_paths("val", "en", "de", download=False)


def test_multi30k_real(data_dir, monkeypatch):
    monkeypatch.setenv("AIAYN_DATA_DIR", str(data_dir))
    train = load_dataset("multi30k", "train", "en", "de")
    assert len(train) == 29000 and train.dropped_empty == 0
    assert train.src[0] == "Two young, White males are outside near many bushes."
    assert all(s == s.strip() and s for s in train.src + train.tgt)
    for split, n in [("val", 1014), ("test_2016_flickr", 1000)]:
        for src, tgt in [("en", "fr"), ("cs", "de")]:
            assert len(load_dataset("multi30k", split, src, tgt)) == n
    fr = load_dataset("multi30k", "train", "fr", "en")
    assert all(s == s.strip() for s in fr.src)  # train.fr has 27 lines with leading spaces


def test_wmt14_real(data_dir, monkeypatch):
    if not (data_dir / "wmt14-en-de").is_dir():
        pytest.skip(f"{data_dir} holds no wmt14-en-de/")
    monkeypatch.setenv("AIAYN_DATA_DIR", str(data_dir))
    test = load_dataset("wmt14-en-de", "test", "en", "de")
    assert len(test) == 3003 and test.name == "wmt14-en-de/test.en-de"
    val = load_dataset("wmt14-en-de", "newstest2013", "de", "en")
    assert len(val) == 3000
