"""`aiayn experiment table3|table1` and `aiayn parse prepare|train|eval`, end to end on tiny
slices of the real corpora."""

from __future__ import annotations

import json
import math

import pytest
from nltk.tree import Tree

from aiayn.cli import main
from aiayn.experiments.table3 import ROW_NAMES
from aiayn.parsing.trees import TargetForm, canonical, is_well_formed, linearize


@pytest.mark.slow
def test_table3_runs_scores_and_resumes(data_dir, tmp_path, capsys):
    from aiayn.data.corpus import load_dataset

    files = []
    for split, k in (("train", 200), ("val", 30)):  # a slice of Multi30k as a "files" corpus
        pairs = load_dataset("multi30k", split, "en", "de")
        for side, lines in (("src", pairs.src[:k]), ("tgt", pairs.tgt[:k])):
            path = tmp_path / f"{split}.{side}"
            path.write_text("\n".join(lines) + "\n", encoding="utf-8")
            files.append(path)
    out = tmp_path / "t3"
    argv = ["experiment", "table3", "--scale", "tiny", "--dataset", "files",
            "--rows", "base,C1,R", "--minutes-per-row", "0.02", "--window", "3",
            "--dev-sentences", "8", "--out", str(out), "--no-progress", "--json"]
    for name, path in zip(("train_src", "train_tgt", "valid_src", "valid_tgt"), files):
        argv += ["--set", f"data.{name}={path}"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["row"] for r in rows] == ["base", "C1", "R"]
    assert rows[1]["N"] == 1 and rows[0]["N"] == 2  # tiny's N = 2, scaled by 2/6
    assert rows[2]["attention_window"] == 3 and rows[0]["attention_window"] is None
    for r in rows:
        # perplexity per subword: e to the row's own validation nll
        nll = json.loads((out / "rows" / r["row"] / "train_summary.json").read_text())[
            "valid_nll"]
        assert r["dev_ppl"] == pytest.approx(math.exp(nll), abs=1e-3)
        assert r["steps"] > 0 and r["bleu_signature"].startswith("nrefs:1|")
        assert r["bleu_protocol"] == "sacrebleu"  # a "files" corpus: corpus_bleu's rule
        assert r["dev_bleu_sentences"] == 8 and r["parameters"] > 0
    assert rows[1]["parameters"] < rows[0]["parameters"]
    table = (out / "table3.md").read_text()
    assert "| C1 | 1 |" in table and "Dev BLEU: sacreBLEU" in table
    assert (out / "table3.png").stat().st_size > 1000
    assert json.loads((out / "table3.json").read_text())["rows"] == rows

    # finished rows are kept; an interrupted one (checkpoint, no row.json) continues
    done = (out / "rows" / "base" / "row.json").read_text()
    (out / "rows" / "C1" / "row.json").unlink()
    assert main([a for a in argv if a != "--json"]) == 0
    log = capsys.readouterr().out
    assert "row base done before, kept" in log and "row C1 (resuming)" in log
    assert (out / "rows" / "base" / "row.json").read_text() == done
    assert (out / "rows" / "C1" / "row.json").is_file()


def test_table3_trains_rows_in_parallel_with_base_seeds(data_dir, tmp_path, capsys):
    from aiayn.data.corpus import load_dataset

    argv = ["experiment", "table3", "--scale", "tiny", "--dataset", "files", "--rows",
            "base,C1", "--minutes-per-row", "0.02", "--dev-sentences", "8", "--out",
            str(tmp_path / "t3"), "--no-progress", "--json", "--base-seeds", "2",
            "--parallel", "2"]
    for split, k in (("train", 200), ("val", 30)):
        pairs = load_dataset("multi30k", split, "en", "de")
        for side, lines in (("src", pairs.src[:k]), ("tgt", pairs.tgt[:k])):
            path = tmp_path / f"{split}.{side}"
            path.write_text("\n".join(lines) + "\n", encoding="utf-8")
            name = {"train": "train", "val": "valid"}[split]
            argv += ["--set", f"data.{name}_{side}={path}"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["row"], r["job"]) for r in rows] == [("base", "base"), ("base", "base-seed2"),
                                                    ("C1", "C1")]
    assert rows[1]["seed"] == rows[0]["seed"] + 1 and rows[1]["N"] == rows[0]["N"]
    for job in ("base", "base-seed2", "C1"):  # each in its own one-thread process, logged
        assert "table3: [1/1] row " + job in (tmp_path / "t3" / "rows" / f"{job}.log").read_text()
    saved = json.loads((tmp_path / "t3" / "table3.json").read_text())
    spread = saved["base_spread"]
    assert spread["dev_bleu"]["values"] == [rows[0]["dev_bleu"], rows[1]["dev_bleu"]]
    assert spread["dev_ppl"]["spread"] == pytest.approx(abs(rows[0]["dev_ppl"] -
                                                            rows[1]["dev_ppl"]), abs=1e-3)
    table = (tmp_path / "t3" / "table3.md").read_text()
    assert "Base row over 2 seeds" in table and "| base (seed " in table
    # several seeds need the base row
    assert main(argv[:7] + ["C1"] + argv[8:]) == 2
    assert "base row" in capsys.readouterr().err


def test_a_signal_stops_table3_without_scoring_the_unfinished_row(data_dir, tmp_path, capsys):
    """Ctrl-C during a row's training keeps its checkpoint but writes no row.json (a row cut
    short is not a row of the table), exits 130, and the same command continues the row."""
    from aiayn.data.corpus import load_dataset

    out = tmp_path / "t3"
    argv = ["experiment", "table3", "--scale", "tiny", "--dataset", "files", "--rows", "base",
            "--minutes-per-row", "0.3", "--dev-sentences", "4", "--out", str(out),
            "--no-progress", "--set", "train.log_every_steps=1"]
    for split, k in (("train", 200), ("val", 20)):
        pairs = load_dataset("multi30k", split, "en", "de")
        for side, lines in (("src", pairs.src[:k]), ("tgt", pairs.tgt[:k])):
            path = tmp_path / f"{split}.{side}"
            path.write_text("\n".join(lines) + "\n", encoding="utf-8")
            argv += ["--set", f"data.{'train' if split == 'train' else 'valid'}_{side}={path}"]
    metrics = out / "rows" / "base" / "metrics.jsonl"

    from interrupt import interrupted_once

    code = interrupted_once(
        lambda: metrics.is_file() and b'"kind": "train"' in metrics.read_bytes(),
        lambda: main(argv))
    log = capsys.readouterr()
    assert code == 130, log.err
    assert not (out / "rows" / "base" / "row.json").exists()
    assert "Rerun the same command to continue it" in log.out
    summary = json.loads((out / "rows" / "base" / "train_summary.json").read_text())
    assert summary["stop_reason"] == "signal SIGINT"
    assert main(argv) == 0
    assert "row base (resuming)" in capsys.readouterr().out
    row = json.loads((out / "rows" / "base" / "row.json").read_text())
    assert row["steps"] > summary["steps"]


def test_table3_rejects_unknown_rows(tmp_path, capsys):
    assert main(["experiment", "table3", "--rows", "base,Q", "--minutes-per-row", "1",
                 "--out", str(tmp_path)]) == 2
    assert "unknown Table 3 row" in capsys.readouterr().err
    assert "R" in ROW_NAMES


def test_table1_measures_fits_and_plots(tmp_path, capsys):
    out = tmp_path / "t1"
    assert main(["experiment", "table1", "--n", "8", "16", "32", "--d", "16", "--h", "2",
                 "--r", "2", "--repeats", "1", "--out", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    kinds = [s["kind"] for s in result["summary"]]
    assert kinds == ["self-attention", "restricted self-attention", "recurrent",
                     "convolutional"]
    saved = json.loads((out / "table1.json").read_text())
    assert len(saved["records"]) == 12
    assert {r["sequential_ops"] for r in saved["records"] if r["kind"] == "recurrent"} == \
        {8, 16, 32}
    assert "O(n²·d)" in (out / "table1.md").read_text()
    assert (out / "table1.png").stat().st_size > 1000


def test_parse_prepare_train_eval(data_dir, tmp_path, capsys):
    data, run = tmp_path / "data", tmp_path / "run"
    assert main(["parse", "prepare", "--treebank",
                 str(data_dir / "ptb-sample" / "treebank.zip"), "--out", str(data),
                 "--max-files", "12", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["sentences"]["test"] > 0 and summary["sentences"]["dev"] > 0
    split = json.loads((data / "split.json").read_text())["files"]
    assert not set(split["test"]) & (set(split["train"]) | set(split["dev"]))
    assert json.loads((data / "split.json").read_text())["target_form"] == \
        "words+labelled-close"  # the default
    for line_src, line_tgt in zip((data / "train.src").read_text().splitlines(),
                                  (data / "train.tgt").read_text().splitlines()):
        plain, matched = canonical(line_tgt.split(), TargetForm(labelled_close=True,
                                                                 words=True))
        assert matched and is_well_formed(plain, len(line_src.split()))

    assert main(["parse", "train", "--data", str(data), "--run-dir", str(run),
                 "--minutes", "0.03", "--set", "model.N=1", "--set", "model.d_model=32",
                 "--set", "model.d_ff=64", "--set", "model.d_k=8", "--set", "model.d_v=8",
                 "--no-progress", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] > 0

    assert main(["parse", "eval", str(run), "--data", str(data), "--beam-size", "3",
                 "--limit", "6", "--no-progress", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["sentences"] == 6 and res["repaired"] == 0 and res["constrained"]
    for name in ("model", "right_branching"):  # F1 is the harmonic mean of P and R
        s = res[name]
        p, r = s["matched"] / s["test_brackets"], s["matched"] / s["gold_brackets"]
        f1 = 200 * p * r / (p + r) if p + r else 0.0
        assert s["f1"] == pytest.approx(f1, abs=0.01) and s["precision"] == \
            pytest.approx(100 * p, abs=0.01)
    assert res["right_branching"]["f1"] > 0
    assert res["right_branching"]["gold_brackets"] == res["model"]["gold_brackets"] > 0
    assert res["gold_round_trip_f1"] == 100.0  # the target form loses nothing
    assert 0.0 <= res["teacher_forced_accuracy"] <= 100.0
    assert res["flat"]["matched"] <= res["flat"]["test_brackets"] == 6  # one bracket each
    for name in ("model", "right_branching", "flat"):  # unlabelled matches include labelled
        assert res["unlabelled"][name]["matched"] >= res[name]["matched"]
    # trees over the real words (test.src holds rare words as their class, --min-count 2)
    words = [Tree.fromstring(line).leaves()
             for line in (data / "test.gold").read_text().splitlines()][:6]
    parsed = (run / "test.parsed").read_text().splitlines()
    # a PCFG file (bench/pcfg_baseline.py's form) joins the table, on the sentences it holds;
    # here its "parses" are the right-branching trees of sentences 1 and 3
    from aiayn.parsing.trees import right_branching, to_line

    pcfg_file = tmp_path / "pcfg.jsonl"
    pcfg_file.write_text("\n".join([json.dumps({"settings": {"split": "test"}})] + [
        json.dumps({"index": i, "tree": to_line(right_branching(words[i]))}) for i in (1, 3)]))
    assert main(["parse", "eval", str(run), "--data", str(data), "--beam-size", "3",
                 "--pcfg", str(pcfg_file), "--no-progress", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["sentences"] == 2 and res["pcfg"] == res["right_branching"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"index": 1, "tree": "(S (XX no) (XX such))"}))
    assert main(["parse", "eval", str(run), "--data", str(data), "--pcfg", str(bad)]) == 2
    assert "the tree of sentence 1 does not have the words" in capsys.readouterr().err
    for w, line in zip(words, parsed, strict=True):
        tree = Tree.fromstring(line)
        assert tree.leaves() == w
        assert is_well_formed(linearize(tree)[1], len(w))


def test_parse_xx_form_and_an_ensemble(data_dir, tmp_path, capsys):
    """Vinyals et al.'s plain form (XX for each word, bare closes) end to end: prepare writes
    it when asked (and says so in split.json), eval reads it back from there, decodes an
    ensemble of two runs with it, and every output is a tree of the sentence's words. Words
    seen once are their unknown-word class in training (--min-count 2), and the outputs are
    trees of the real words."""
    data = tmp_path / "data"
    assert main(["parse", "prepare", "--treebank",
                 str(data_dir / "ptb-sample" / "treebank.zip"), "--out", str(data),
                 "--max-files", "12", "--target-form", "xx", "--min-count", "2",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["target_form"] == "xx" and summary["min_count"] == 2
    first = (data / "train.tgt").read_text().splitlines()[0].split()
    words = (data / "train.src").read_text().splitlines()[0].split()
    assert is_well_formed(first, len(words)) and first.count("XX") == len(words)
    runs = [tmp_path / "a", tmp_path / "b"]
    for seed, run in enumerate(runs):
        assert main(["parse", "train", "--data", str(data), "--run-dir", str(run),
                     "--minutes", "0.02", "--set", "model.N=1", "--set", "model.d_model=32",
                     "--set", "model.d_ff=64", "--set", "model.d_k=8", "--set", "model.d_v=8",
                     "--set", f"train.seed={seed}", "--no-progress", "--json"]) == 0
    capsys.readouterr()
    assert main(["parse", "eval", *map(str, runs), "--data", str(data), "--beam-size", "2",
                 "--limit", "5", "--out", str(tmp_path / "ens"), "--no-progress",
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["target_form"] == "xx" and res["repaired"] == 0
    assert res["checkpoints"] == [str(r) for r in runs]
    assert res["gold_round_trip_f1"] == 100.0
    test_words = [Tree.fromstring(line).leaves()
                  for line in (data / "test.gold").read_text().splitlines()][:5]
    model_words = [line.split() for line in (data / "test.src").read_text().splitlines()][:5]
    assert [len(w) for w in model_words] == [len(w) for w in test_words]
    assert any(m.startswith("<UNK") for s in model_words for m in s)
    parsed = (tmp_path / "ens" / "test.parsed").read_text().splitlines()
    assert [Tree.fromstring(line).leaves() for line in parsed] == test_words


def test_parse_eval_names_missing_data(tmp_path, capsys):
    assert main(["parse", "eval", str(tmp_path), "--data", str(tmp_path / "nope")]) == 2
    assert "aiayn parse prepare" in capsys.readouterr().err
