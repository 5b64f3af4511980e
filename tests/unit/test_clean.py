"""Cleaning a training corpus by fairseq's prepare-wmt14en2de.sh rules (aiayn.data.clean)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

from aiayn.data.clean import MAX_RATIO, MAX_WORDS, main


def test_rules_drop_empty_long_and_lopsided_pairs_and_count_each(tmp_path, capsys):
    long = " ".join(["w"] * (MAX_WORDS + 1))
    pairs = [("a b c", "x y z"),          # kept
             ("", "x"),                    # empty side
             (long, long),                 # over 250 words
             ("a b", "x y z w"),           # 2 vs 4 words: ratio 2 > 1.5
             ("a b c d e f", "x y z w"),   # 6 vs 4: exactly 1.5, kept
             ("  spaced  out ", "x y")]    # stripped, kept
    (tmp_path / "in.en").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    (tmp_path / "in.de.gz").write_bytes(gzip.compress("".join(t + "\n" for _, t in pairs)
                                                      .encode("utf-8")))
    out_src, out_tgt = tmp_path / "out.en", tmp_path / "out.de"
    assert main(["--src", str(tmp_path / "in.en"), "--tgt", str(tmp_path / "in.de.gz"),
                 "--out-src", str(out_src), "--out-tgt", str(out_tgt), "--json"]) == 0
    counts = json.loads(capsys.readouterr().out)
    assert counts == {"read": 6, "kept": 3, "empty": 1, "too_long": 1, "ratio": 1}
    assert out_src.read_text(encoding="utf-8").splitlines() == ["a b c", "a b c d e f",
                                                                "spaced  out"]
    assert out_tgt.read_text(encoding="utf-8").splitlines() == ["x y z", "x y z w", "x y"]
    assert MAX_RATIO == 1.5


def test_misaligned_inputs_are_one_line_and_write_nothing(tmp_path):
    (tmp_path / "a").write_text("one\ntwo\n", encoding="utf-8")
    (tmp_path / "b").write_text("eins\n", encoding="utf-8")
    res = subprocess.run([sys.executable, "-m", "aiayn.data.clean", "--src", str(tmp_path / "a"),
                          "--tgt", str(tmp_path / "b"), "--out-src", str(tmp_path / "c"),
                          "--out-tgt", str(tmp_path / "d")], capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"{tmp_path / 'a'} has 2 lines but {tmp_path / 'b'} has 1" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
