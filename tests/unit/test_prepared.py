"""The prepared corpus (aiayn.data.prepared): the same pairs, batches and tensors as the
in-memory encoding, a cache that notices changed inputs, and every kind of bad folder."""

from __future__ import annotations

import errno
import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from aiayn.data import prepared as prep
from aiayn.data.batching import collate, encode_corpus, make_batches
from aiayn.data.corpus import load_dataset, load_parallel
from aiayn.data.prepared import PreparedCorpus, Settings, prepare
from aiayn.data.vocab import Vocabulary
from aiayn.errors import DataError, UserError

SRC = ["a man rides a horse .", "two dogs play in the snow", "", "the cat sleeps",
       "a very long sentence that goes on and on and on and on and on and on and on",
       "x", "people walk down a busy street at night", "a girl reads a book"]
TGT = ["ein mann reitet ein pferd .", "zwei hunde spielen im schnee", "leer", "die katze schläft",
       "kurz", "y y y y y y y y y y y y", "menschen gehen nachts eine belebte straße entlang",
       "ein mädchen liest ein buch"]


def write_pair(folder: Path, src=SRC, tgt=TGT, gz: bool = False) -> tuple[Path, Path]:
    paths = []
    for name, lines in (("train.en", src), ("train.de", tgt)):
        data = ("\n".join(lines) + "\n").encode()
        path = folder / (name + (".gz" if gz else ""))
        path.write_bytes(gzip.compress(data) if gz else data)
        paths.append(path)
    return paths[0], paths[1]


@pytest.fixture
def vocab() -> Vocabulary:
    return Vocabulary.learn(SRC + TGT, 120, "bpe")


@pytest.mark.parametrize("gz", [False, True])
def test_prepared_pairs_are_the_in_memory_encoding(tmp_path, vocab, gz):
    src, tgt = write_pair(tmp_path, gz=gz)
    corpus = prepare(src, tgt, vocab, tmp_path / "p", Settings(max_len=16), chunk_pairs=3)
    enc = encode_corpus(vocab, load_parallel(src, tgt), 16)
    assert len(corpus) == len(enc) and corpus.filtered == enc.filtered >= 1
    assert corpus.dropped_empty == 1
    assert [corpus.pair(i) for i in range(len(corpus))] == list(zip(enc.src, enc.tgt))
    assert corpus.index.tolist() == enc.index
    assert np.array_equal(corpus.src_lengths(), enc.src_lengths())
    assert np.array_equal(corpus.tgt_lengths(), enc.tgt_lengths())
    assert np.array_equal(corpus.target_token_ids(), enc.target_token_ids())
    assert corpus._a["src_ids"].dtype == np.uint16  # the vocabulary fits 16 bits
    for rows in ([0, 3, 1], [2], list(range(len(enc)))):
        a, b = collate(corpus, rows, start_id=1), collate(enc, rows, start_id=1)
        for name in ("src", "tgt_in", "tgt_out"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.indices == b.indices
    m = corpus.manifest
    assert m["counts"]["lines"] == len(SRC) and m["counts"]["kept"] == len(enc)
    assert m["vocabulary"]["fingerprint"] == vocab.fingerprint
    assert len(m["inputs"]["src"]["sha256"]) == 64
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "p").stat().st_mode & 0o777 == 0o777 & ~umask  # as mkdir makes it


def test_multi30k_keeps_its_batches_and_tensors(data_dir, tmp_path):
    """The figures of every Multi30k run rest on this: the prepared corpus gives the same
    batches (same seed, every shard) and the same padded tensors as the in-memory one."""
    from aiayn.data.splits import split_paths
    from aiayn.config import DataConfig

    text = load_dataset("multi30k", "train", "en", "de")
    vocab = Vocabulary.learn(text.src[:5000] + text.tgt[:5000], 1000, "bpe")
    enc = encode_corpus(vocab, text, 40)
    src, tgt = split_paths(DataConfig(), "train")
    corpus = prepare(src, tgt, vocab, tmp_path / "p", Settings(max_len=40))
    assert corpus.index.tolist() == enc.index
    for shards in (1, 2):
        for epoch in (0, 3):
            for k in range(shards):
                kw = dict(seed=7, epoch=epoch, num_shards=shards, shard_index=k)
                a = make_batches(corpus.src_lengths(), corpus.tgt_lengths(), 1024, **kw)
                b = make_batches(enc.src_lengths(), enc.tgt_lengths(), 1024, **kw)
                assert a == b
    for rows in a[:20]:
        x, y = collate(corpus, rows, start_id=1), collate(enc, rows, start_id=1)
        assert torch.equal(x.src, y.src) and torch.equal(x.tgt_out, y.tgt_out)
        assert torch.equal(x.tgt_in, y.tgt_in) and x.indices == y.indices


def test_filters_count_what_they_drop(tmp_path, vocab):
    src, tgt = write_pair(tmp_path)
    corpus = prepare(src, tgt, vocab, tmp_path / "p", Settings(max_len=64, max_ratio=1.5))
    c = corpus.manifest["counts"]
    lens_s, lens_t = corpus.src_lengths() - 1, corpus.tgt_lengths() - 1
    assert (np.maximum(lens_s, lens_t) <= 1.5 * np.minimum(lens_s, lens_t)).all()
    assert c["over_ratio"] >= 2 and c["over_max_len"] == 0  # "x"/"y y …" and long/"kurz"
    assert c["kept"] + c["over_ratio"] + c["empty"] == c["lines"]
    limited = prepare(src, tgt, vocab, tmp_path / "q", Settings(limit=3))
    assert limited.manifest["counts"]["beyond_limit"] == len(SRC) - 1 - 3
    assert limited.index.tolist() == [0, 1, 2]


def test_prepare_again_is_a_cache_hit_until_an_input_changes(tmp_path, vocab):
    src, tgt = write_pair(tmp_path)
    first = prepare(src, tgt, vocab, tmp_path / "p")
    manifest_time = (tmp_path / "p" / prep.MANIFEST_FILE).stat().st_mtime_ns
    lines: list[str] = []
    again = prepare(src, tgt, vocab, tmp_path / "p", log=lines.append)
    assert again.fingerprint == first.fingerprint and "reused" in lines[-1]
    os.utime(src, ns=(1, 1))  # same bytes, another time: checked by sha256, still a hit
    prepare(src, tgt, vocab, tmp_path / "p")
    assert (tmp_path / "p" / prep.MANIFEST_FILE).stat().st_mtime_ns == manifest_time
    src.write_text("\n".join(["changed"] + SRC[1:]) + "\n")
    changed = prepare(src, tgt, vocab, tmp_path / "p")
    assert changed.fingerprint != first.fingerprint
    changes = prep.describe_changes(first.manifest, changed.manifest)
    assert len(changes) == 1 and "source file (train.en) changed" in changes[0]
    other = prepare(src, tgt, vocab, tmp_path / "p", Settings(max_len=10))
    assert prep.describe_changes(changed.manifest, other.manifest) == ["max_len 256 -> 10"]


def test_a_truncated_or_foreign_folder_is_refused_naming_the_file(tmp_path, vocab):
    src, tgt = write_pair(tmp_path)
    prepare(src, tgt, vocab, tmp_path / "p")
    ids = tmp_path / "p" / "tgt.ids.bin"
    ids.write_bytes(ids.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"tgt\.ids\.bin: \d+ bytes, but the manifest says"):
        PreparedCorpus.open(tmp_path / "p")
    (tmp_path / "p" / "index.bin").unlink()
    with pytest.raises(DataError, match=r"index\.bin: missing"):
        PreparedCorpus.open(tmp_path / "p")
    manifest = tmp_path / "p" / prep.MANIFEST_FILE
    manifest.write_text(json.dumps({"format": "fairseq", "format_version": 1}))
    with pytest.raises(DataError, match="not an aiayn prepared corpus"):
        PreparedCorpus.open(tmp_path / "p")
    manifest.write_text("{not json")
    with pytest.raises(DataError, match="not a valid manifest"):
        PreparedCorpus.open(tmp_path / "p")
    manifest.unlink()
    with pytest.raises(DataError, match="not a prepared corpus .no manifest.json"):
        PreparedCorpus.open(tmp_path / "p")
    with pytest.raises(DataError, match="not a folder"):
        PreparedCorpus.open(tmp_path / "nowhere")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not a prepared corpus; not overwriting"):
        prepare(src, tgt, vocab, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_a_vocabulary_that_did_not_make_the_ids_is_refused(tmp_path, vocab):
    src, tgt = write_pair(tmp_path)
    corpus = prepare(src, tgt, vocab, tmp_path / "p")
    assert corpus.load_vocabulary().fingerprint == vocab.fingerprint
    other = Vocabulary.learn(SRC + TGT, 100, "bpe")
    with pytest.raises(DataError, match=r"is not the one .* was prepared with"):
        corpus.check_vocabulary(other)


def test_a_disk_that_fills_during_prepare_leaves_no_complete_looking_folder(
        tmp_path, vocab, monkeypatch):
    src, tgt = write_pair(tmp_path)
    good = prepare(src, tgt, vocab, tmp_path / "p", chunk_pairs=2)
    write = prep._write
    calls = {"n": 0}

    def full_disk(f, array):
        calls["n"] += 1
        if calls["n"] > 8:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(f, array)

    monkeypatch.setattr(prep, "_write", full_disk)
    for target in (tmp_path / "new", tmp_path / "p"):  # a new folder; replacing a good one
        calls["n"] = 0
        with pytest.raises(OSError, match="No space left"):
            prepare(src, tgt, vocab, target, Settings(max_len=20), chunk_pairs=2)
    assert not (tmp_path / "new").exists()
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name] == []
    assert PreparedCorpus.open(tmp_path / "p").fingerprint == good.fingerprint  # untouched


def test_misaligned_and_broken_inputs_name_the_files(tmp_path, vocab):
    src, tgt = write_pair(tmp_path, tgt=TGT[:-2])
    with pytest.raises(DataError, match=r"train\.de has \d+ lines but .*train\.en has"):
        prepare(src, tgt, vocab, tmp_path / "p")
    src.write_bytes(b"fine\ncaf\xe9\n")
    tgt.write_bytes(b"gut\ngut\n")
    with pytest.raises(DataError, match=r"train\.en, line 2: invalid UTF-8"):
        prepare(src, tgt, vocab, tmp_path / "p")
    assert not (tmp_path / "p").exists()


def test_cli_prepares_then_reuses(tmp_path, vocab, capsys):
    from aiayn.cli import main

    src, tgt = write_pair(tmp_path)
    vocab.save(tmp_path / "v")
    argv = ["prepare", "--src", str(src), "--tgt", str(tgt), "--vocab", str(tmp_path / "v"),
            "-o", str(tmp_path / "p"), "--max-ratio", "1.5"]
    assert main(argv) == 0
    assert "pairs kept" in capsys.readouterr().out
    assert main(argv) == 0
    assert "reused" in capsys.readouterr().out
    assert main(argv[:-2] + ["--max-len", "1"]) == 2
    assert "max_len must be at least 2" in capsys.readouterr().err


def test_runs_started_together_prepare_the_cache_entry_once(tmp_path, vocab, monkeypatch):
    """Table 3's rows and an ensemble's members start side by side on the same files: one
    prepares the cache entry, the others wait and reuse it, and every one opens a whole
    folder (without the lock each rebuilt it, replacing it under another that was opening)."""
    import threading

    from aiayn.training.distributed import DistInfo

    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path / "cache"))
    src, tgt = write_pair(tmp_path)
    start = threading.Barrier(4)
    logs: list[str] = []
    opened: list[PreparedCorpus] = []
    errors: list[BaseException] = []

    def one_run() -> None:
        start.wait()
        try:
            opened.append(prep.prepare_for_training(src, tgt, vocab, Settings(max_len=16),
                                                    DistInfo(0, 1, 0), logs.append))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=one_run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sum("pairs kept" in line for line in logs) == 1
    assert sum("reused" in line for line in logs) == 3
    assert {len(c) for c in opened} == {len(PreparedCorpus.open(opened[0].directory))}


# --- the lock, the sweep, the cache's keys and limit (issue 81, problem 8) -------------------
CHILD = """
import os, signal, sys, time
from aiayn.data import prepared as prep
from aiayn.data.vocab import Vocabulary
src, tgt, vocab, out, mode = sys.argv[1:6]
write, calls = prep._write, [0]
def patched(f, array):
    calls[0] += 1
    if mode == "kill" and calls[0] > 20:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-write: the arrays are half written
    time.sleep(0.01)  # slow enough that two prepares started together overlap
    write(f, array)
prep._write = patched
prep.prepare(src, tgt, Vocabulary.load(vocab), out, prep.Settings(max_len=int(sys.argv[6])),
             chunk_pairs=40, log=print)
"""


def child(src: Path, tgt: Path, vocab_dir: Path, out: Path, mode: str, max_len: int = 256):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", CHILD, str(src), str(tgt), str(vocab_dir),
                             str(out), mode, str(max_len)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def many_pairs(folder: Path, n: int = 2000) -> tuple[Path, Path]:
    return write_pair(folder, [SRC[i % len(SRC)] or "x" for i in range(n)],
                      [TGT[i % len(TGT)] for i in range(n)])


@pytest.mark.slow  # processes of their own
def test_two_processes_preparing_one_folder_take_turns(tmp_path, vocab):
    """Two `aiayn prepare -o SAME` at once: the second waits on the lock, then reuses the
    first's folder; both succeed, one whole folder results, nothing is left beside it."""
    (tmp_path / "in").mkdir()
    src, tgt = many_pairs(tmp_path / "in")
    vocab.save(tmp_path / "v")
    out = tmp_path / "out" / "p"
    procs = [child(src, tgt, tmp_path / "v", out, "slow") for _ in range(2)]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    assert sum("pairs kept" in log for log in logs) == 1, logs
    assert sum("reused" in log for log in logs) == 1, logs
    corpus = PreparedCorpus.open(out)
    assert len(corpus) == 2000 and corpus.pair(7) == corpus.pair(15)
    assert [p.name for p in out.parent.iterdir()] == ["p"]  # no lock file, no partial


@pytest.mark.slow  # processes of their own
def test_a_killed_prepare_leaves_the_old_folder_and_the_next_one_sweeps(tmp_path, vocab):
    (tmp_path / "in").mkdir()
    src, tgt = many_pairs(tmp_path / "in")
    vocab.save(tmp_path / "v")
    out = tmp_path / "out" / "p"
    good = prepare(src, tgt, vocab, out, Settings(max_len=64))
    proc = child(src, tgt, tmp_path / "v", out, "kill", max_len=32)  # another setting: rebuild
    proc.communicate(timeout=120)
    assert proc.returncode == -9
    partial = [p.name for p in out.parent.iterdir() if ".partial-" in p.name]
    assert len(partial) == 1 and any((out.parent / partial[0]).iterdir())
    assert PreparedCorpus.open(out).fingerprint == good.fingerprint  # untouched
    lines: list[str] = []
    again = prepare(src, tgt, vocab, out, Settings(max_len=32), log=lines.append)
    assert "removed 1 unfinished folder" in lines[0] and partial[0] in lines[0]
    assert [p.name for p in out.parent.iterdir()] == ["p"]
    assert again.manifest["settings"]["max_len"] == 32


def test_a_touched_input_finds_its_cache_entry(tmp_path, vocab, monkeypatch):
    from aiayn.training.distributed import DistInfo

    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path / "cache"))
    src, tgt = write_pair(tmp_path)
    lines: list[str] = []
    first = prep.prepare_for_training(src, tgt, vocab, Settings(), DistInfo(), lines.append)
    os.utime(src, ns=(10**18, 10**18))  # `touch`: the same bytes at another time
    lines.clear()
    again = prep.prepare_for_training(src, tgt, vocab, Settings(), DistInfo(), lines.append)
    assert again.directory == first.directory and "reused" in lines[-1]
    copy = tmp_path / "elsewhere"
    copy.mkdir()
    src2, tgt2 = write_pair(copy)  # the same bytes under another name: the same entry
    assert prep.cache_folder(src2, tgt2, vocab, Settings()) == first.directory
    monkeypatch.setenv(prep.FULL_HASH_ENV, "1")
    assert prep.cache_folder(src2, tgt2, vocab, Settings()) == first.directory  # < 2 MiB: all
    big = tmp_path / "big.txt"
    big.write_bytes(b"a b c\n" * 700_000)
    ends = prep.content_key(big)
    with open(big, "r+b") as f:  # the middle changed, the size kept
        f.seek(2_100_000)
        f.write(b"x")
    assert prep.content_key(big) == ends and prep.content_key(big, full=True) != ends


def test_the_cache_keeps_its_size_limit_evicting_the_least_recently_used(
        tmp_path, vocab, monkeypatch):
    from aiayn.training.distributed import DistInfo

    monkeypatch.setenv("AIAYN_CACHE_DIR", str(tmp_path / "cache"))
    src, tgt = write_pair(tmp_path)
    made = [prep.prepare_for_training(src, tgt, vocab, Settings(max_len=m), DistInfo(),
                                      quiet).directory for m in (64, 128, 256)]
    one = sum(f.stat().st_size for f in made[0].iterdir())
    os.utime(made[0])  # the oldest used again: now the second is the least recently used
    (made[0].parent / ".x.partial-123").mkdir()  # left by a killed prepare
    monkeypatch.setenv(prep.CACHE_LIMIT_ENV, str(2.5 * one / 1e9))
    lines: list[str] = []
    prep.prepare_for_training(src, tgt, vocab, Settings(max_len=256), DistInfo(), lines.append)
    assert sorted(p.name for p in made[0].parent.iterdir()) == sorted(
        [made[0].name, made[2].name])
    assert any(made[1].name in line and "least recently used" in line for line in lines)
    monkeypatch.setenv(prep.CACHE_LIMIT_ENV, "lots")
    with pytest.raises(UserError, match="AIAYN_CACHE_MAX_GB='lots': not a size"):
        prep.prepare_for_training(src, tgt, vocab, Settings(), DistInfo(), quiet)


def quiet(_msg: str) -> None:
    pass


def test_a_folder_of_the_other_byte_order_is_refused(tmp_path, vocab):
    import sys

    src, tgt = write_pair(tmp_path)
    corpus = prepare(src, tgt, vocab, tmp_path / "p")
    assert corpus.manifest["byteorder"] == sys.byteorder
    other = "big" if sys.byteorder == "little" else "little"
    path = tmp_path / "p" / prep.MANIFEST_FILE
    path.write_text(json.dumps({**corpus.manifest, "byteorder": other}))
    with pytest.raises(DataError, match=rf"arrays are {other}-endian, this machine is "
                                        rf"{sys.byteorder}-endian: run `aiayn prepare` again"):
        PreparedCorpus.open(tmp_path / "p")
    lines: list[str] = []
    prepare(src, tgt, vocab, tmp_path / "p", log=lines.append)  # prepared anew, not reused
    assert "pairs kept" in lines[-1]


def test_a_prepare_that_keeps_no_pair_is_refused(tmp_path, vocab, capsys):
    from aiayn.cli import main

    src, tgt = write_pair(tmp_path)
    vocab.save(tmp_path / "v")
    argv = ["prepare", "--src", str(src), "--tgt", str(tgt), "--vocab", str(tmp_path / "v"),
            "-o", str(tmp_path / "out" / "p"), "--max-len", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none of the 7 training pairs fits --max-len 2 tokens" in err[0]
    assert not (tmp_path / "out" / "p").exists()
    assert list((tmp_path / "out").iterdir()) == []  # no partial folder either


def test_where_a_folder_cannot_be_locked_a_lock_file_is_used_and_removed(
        tmp_path, vocab, monkeypatch):
    import errno as errno_module
    import fcntl
    import stat

    flock = fcntl.flock
    locked_files: list[int] = []

    def no_folder_locks(fd, op):  # as some network file systems answer
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno_module.ENOLCK, "No locks available")
        locked_files.append(fd)
        return flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", no_folder_locks)
    src, tgt = write_pair(tmp_path)
    out = tmp_path / "out" / "p"
    prepare(src, tgt, vocab, out)
    assert locked_files and [p.name for p in out.parent.iterdir()] == ["p"]
