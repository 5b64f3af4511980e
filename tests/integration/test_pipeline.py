"""The main job through the CLI on a slice of Multi30k (issue: the end-to-end job). CI runs this
instead of the full hour: every artefact appears, the loss falls well below its start, and the
test translations are line-aligned with the source."""

from __future__ import annotations

import gzip
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from figures import assert_drawn  # noqa: E402

from aiayn.cli import main  # noqa: E402
from aiayn.evaluation.bleu import multi30k_tok_bleu, read_lines, sacrebleu_scores  # noqa: E402

pytestmark = pytest.mark.slow  # whole pipelines: 4-46 s each (`-m "not slow"` leaves them out)


def test_pipeline_on_a_multi30k_slice(data_dir: Path, tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    job = ["pipeline", "--preset", "tiny", "--run-dir", str(run_dir), "--no-progress",
           "--set", "decode.batch_size=250", "--json"]
    code = main(job + ["--set", "data.train_limit=4000", "--set", "train.max_steps=240",
                       "--set", "train.lr_scale=1.0", "--set", "train.checkpoint_every_steps=60",
                       "--set", "train.eval_every_steps=120", "--set", "train.ema_decay=0.99",
                       "--average", "3", "1"])
    assert code == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads((run_dir / "results.json").read_text()) == results

    # each averaging width, and the moving average of the weights, was scored on val; the
    # best one is the model on disk that translated the test set
    by_average = results["valid_bleu_by_average"]
    assert list(by_average) == ["3", "1", "ema"]
    assert all(set(v) == {"0.6"} for v in by_average.values())
    width = max(("3", "1", "ema"), key=lambda k: by_average[k]["0.6"])
    assert results["weights"] == width
    assert results["valid_bleu_by_alpha"] == by_average[width]
    if width == "ema":
        assert results["averaged"] == ["ema"]
    else:
        steps = ["step-00000120", "step-00000180", "step-00000240"]
        assert results["averaged"] == steps[-int(width):]
        meta = json.loads((run_dir / "averaged" / "meta.json").read_text())
        assert [Path(p).name for p in meta["averaged_from"]] == results["averaged"]
    ema_meta = json.loads((run_dir / "ema" / "meta.json").read_text())
    assert ema_meta["step"] == 240 and ema_meta["ema_updates"] == 240

    for name in ("config.json", "tokenizer.json", "metrics.jsonl", "train_summary.json",
                 "results.json", "curves.png", "test.hyp.de", "averaged/model.safetensors",
                 "best/model.safetensors", "ema/model.safetensors"):
        assert (run_dir / name).is_file(), name
    assert [p.name for p in sorted((run_dir / "checkpoints").iterdir())] == \
        ["step-00000120", "step-00000180", "step-00000240"]
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert_drawn(run_dir / "curves.png")

    train = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in train if r["kind"] == "train"]
    assert losses[-1] < 0.7 * losses[0], (losses[0], losses[-1])
    assert any(r["kind"] == "valid" and "valid_bleu" in r for r in train)

    with gzip.open(data_dir / "multi30k" / "test_2016_flickr.en.gz", "rt") as f:
        n_src = len(f.read().splitlines())
    hyps = (run_dir / "test.hyp.de").read_text(encoding="utf-8").split("\n")
    assert hyps[-1] == "" and len(hyps) - 1 == n_src == 1000
    # the scores reported are those of the file written, against the test references
    refs = read_lines(data_dir / "multi30k" / "test_2016_flickr.de.gz")
    scores = sacrebleu_scores(hyps[:-1], refs)
    assert results["sacrebleu_bleu"] == round(scores["bleu"], 2)
    assert results["sacrebleu_chrf"] == round(scores["chrf"], 2)
    tok_refs = read_lines(results["multi30k_tok_reference"])
    assert results["multi30k_tok_bleu"] == round(multi30k_tok_bleu(hyps[:-1], tok_refs, "de"), 2)
    assert results["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert results["multi30k_tok_reference"].endswith("test_2016_flickr.lc.norm.tok.de.gz")

    # the same finished run, resumed with the widths in the other order and without repeating
    # train.ema_decay (the run's config.json keeps it, and its 240 steps): training has nothing
    # left to do, val scores the same weights again, and the same candidate is chosen. Unless
    # the two widths tie on val, the winning width comes last in one order (the loop's average
    # is the one on disk) and not in the other (it is averaged again).
    code = main(job + ["--resume", "--average", "1", "3"])
    assert code == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["train_steps"] == 240
    assert again["valid_bleu_by_average"] == {k: by_average[k] for k in ("1", "3", "ema")}
    # the best on val in the new order, a tie going to the first given
    assert again["weights"] == max(("1", "3", "ema"), key=lambda k: by_average[k]["0.6"])
    if again["weights"] == results["weights"]:  # the same model: the same test output
        assert again["averaged"] == results["averaged"]
        assert again["multi30k_tok_bleu"] == results["multi30k_tok_bleu"]
    if again["weights"] != "ema":
        meta = json.loads((run_dir / "averaged" / "meta.json").read_text())
        assert [Path(p).name for p in meta["averaged_from"]] == again["averaged"]


ENSEMBLE = ["pipeline", "--preset", "tiny", "--no-progress", "--json", "--ensemble", "2",
            "--set", "data.train_limit=2000", "--set", "decode.batch_size=250",
            "--set", "train.checkpoint_every_steps=30", "--set", "train.eval_every_steps=60",
            "--set", "decode.max_len_b=10"]  # untrained models decode to the length bound


def test_pipeline_trains_and_decodes_an_ensemble(data_dir: Path, tmp_path: Path,
                                                  capsys) -> None:
    # data_dir: trains on Multi30k, so it skips, saying why, without AIAYN_DATA_DIR
    # train.precision auto (as every preset but `tiny` says): the job then checks int8 on val
    # and may record it as the run's decoding precision (check_reduced_precision)
    run_dir = tmp_path / "run"
    job = ENSEMBLE + ["--run-dir", str(run_dir), "--average", "2", "1",
                      "--set", "train.precision=auto"]
    assert main(job + ["--set", "train.max_steps=60", "--set", "train.seed=7"]) == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    # two members, seeds 7 and 8, one shared vocabulary, each with its own run directory
    assert results["ensemble"] == 2
    assert [m["seed"] for m in results["members"]] == [7, 8]
    assert [m["steps"] for m in results["members"]] == [60, 60]
    # each member's threads: this process's, shared out between the two
    assert results["train_steps"] == 120
    assert results["threads"] == max(1, torch.get_num_threads() // 2)
    for k in (1, 2):
        member = run_dir / f"member-{k}"
        assert (member / "tokenizer.json").read_bytes() == \
            (run_dir / "tokenizer.json").read_bytes()
        assert json.loads((member / "config.json").read_text())["train"]["seed"] == 6 + k
        assert [p.name for p in sorted((member / "checkpoints").iterdir())] == \
            ["step-00000030", "step-00000060"]
        assert "aiayn train" in (run_dir / f"member-{k}.log").read_text()
        assert (member / "curves.png").is_file()
    # ... and one figure of the whole ensemble, both members' curves in it
    assert_drawn(run_dir / "curves.png")
    width = results["weights"]
    assert width in ("2", "1") and results["valid_bleu_by_alpha"] == \
        results["valid_bleu_by_average"][width]
    last = ["step-00000030", "step-00000060"][-int(width):]
    assert results["averaged"] == [f"member-{k}/checkpoints/{s}" for k in (1, 2) for s in last]
    weights = [(run_dir / f"member-{k}" / "averaged" / "model.safetensors").read_bytes()
               for k in (1, 2)]
    assert weights[0] != weights[1]  # two seeds, two models
    hyps = (run_dir / "test.hyp.de").read_text(encoding="utf-8").split("\n")
    tok_refs = read_lines(results["multi30k_tok_reference"])
    assert len(hyps) - 1 == 1000
    assert results["multi30k_tok_bleu"] == round(multi30k_tok_bleu(hyps[:-1], tok_refs, "de"), 2)
    assert_the_run_is_the_model_it_reports(run_dir, results, tmp_path, capsys)

    # a resume must say it is an ensemble's, and then finds both members finished
    assert main(job + ["--resume", "--ensemble", "1"]) == 2
    assert "--ensemble 2" in capsys.readouterr().err
    # ... and a width past the two checkpoints each member saved (keep_last is 3) averages the
    # same two as width 2: it is not decoded again
    assert main(job + ["--resume", "--average", "2", "3", "1"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["train_steps"] == 120
    assert again["valid_bleu_by_average"] == results["valid_bleu_by_average"]
    assert list(again["valid_bleu_by_average"]) == ["2", "1"]

    # a member that cannot start stops the job with its own error, and the other with it
    (run_dir / "member-2" / "config.json").write_text("{not json", encoding="utf-8")
    assert main(job + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert "ensemble member 2 failed" in err and "member-2" in err


def test_a_signal_stops_every_ensemble_member_with_a_checkpoint(data_dir: Path,
                                                                tmp_path: Path,
                                                                capsys) -> None:
    run_dir = tmp_path / "run"

    code = _interrupted_once(  # both members past their first logged steps
        lambda: all(b'"kind": "train"' in _read(run_dir / f"member-{k}" / "metrics.jsonl")
                    for k in (1, 2)),
        ENSEMBLE + ["--run-dir", str(run_dir), "--set", "train.max_steps=100000"])
    assert code == 128 + signal.SIGINT
    assert "--ensemble 2" in capsys.readouterr().err  # the resume command names it
    for k in (1, 2):
        summary = json.loads((run_dir / f"member-{k}" / "train_summary.json").read_text())
        assert summary["stop_reason"] == "signal SIGINT"
        assert 0 < summary["steps"] < 100000
        assert (run_dir / f"member-{k}" / "checkpoints" /
                f"step-{summary['steps']:08d}").is_dir()
    # a new run, one model or an ensemble, is refused before it writes over this one's files
    shared = {name: (run_dir / name).read_bytes() for name in ("config.json", "tokenizer.json")}
    for extra in (["--ensemble", "2"], ["--ensemble", "1"]):
        assert main(ENSEMBLE + ["--run-dir", str(run_dir), *extra]) == 2
        assert "already holds an ensemble of 2: add --resume --ensemble 2" in \
            capsys.readouterr().err
    assert {name: (run_dir / name).read_bytes() for name in shared} == shared


def test_a_signal_while_the_members_start_is_a_stop_not_a_failure(data_dir: Path,
                                                                   tmp_path: Path,
                                                                   capsys) -> None:
    """Before a member's training loop catches signals (Python and torch still loading), the
    forwarded SIGINT ends it with exit 130: the job stops as a single run would, and a resume
    starts both members."""
    run_dir = tmp_path / "run"

    code = _interrupted_once(lambda: (run_dir / "member-1.log").exists(),
                             ENSEMBLE + ["--run-dir", str(run_dir), "--set", "train.max_steps=20"])
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGINT, err
    assert "failed" not in err and "--resume" in err and "--ensemble 2" in err
    assert main(ENSEMBLE + ["--run-dir", str(run_dir), "--resume"]) == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [m["steps"] for m in results["members"]] == [20, 20]


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _interrupted_once(ready, job: list[str]) -> int:
    """Run ``aiayn`` with ``job``, SIGINT sent as soon as ``ready()`` holds; its exit code."""
    from interrupt import interrupted_once

    return interrupted_once(ready, lambda: main(job))


def readme_python() -> str:
    """The README's Python example: the first ```python block under "## Python"."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Python", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def assert_the_run_is_the_model_it_reports(run_dir: Path, results: dict, tmp_path: Path,
                                           capsys) -> None:
    """A finished run directory loads as the model whose test output the job wrote:
    ``aiayn translate --checkpoint RUN`` and the README's Python example give ``test.hyp.de``
    line for line (the job's own batches, one float path). ``aiayn serve`` over the run
    decodes with the same model and settings: a request of 32 lines is one batch there, and
    answers what the run's Translator gives for those 32 lines as one batch. (Whether other
    batches give the same tokens is a property of the kernels, not of aiayn: fp32 did on the
    bf16 class for all 1,000 lines, see docs/hardware.md; the test does not assume it.)"""
    import httpx
    from serving import serve_in_thread

    from aiayn.serve import ServeLimits, create_app
    from aiayn.translator import Translator

    record = json.loads((run_dir / "generation_config.json").read_text(encoding="utf-8"))
    weights = "ema" if results["weights"] == "ema" else "averaged"
    assert record["members"] == [f"member-{k}/{weights}" for k in (1, 2)]
    assert record["decode"]["alpha"] == results["alpha"]
    assert record["decode"]["beam_size"] == results["beam_size"]
    check = results["decode_precision_check"]
    want = "fp32" if check is None else check["chosen"]  # None: the run was trained in fp32
    assert record["precision"] == results["decode_precision"] == want
    if check is not None:
        assert check["fp32"] - check["int8"] <= 0.2 or want == "fp32"
    hyps = (run_dir / "test.hyp.de").read_text(encoding="utf-8").splitlines()
    data = Path(os.environ["AIAYN_DATA_DIR"]) / "multi30k" / "test_2016_flickr.en.gz"

    out = tmp_path / "cli.de"
    assert main(["translate", "--checkpoint", str(run_dir), "-i", str(data), "-o", str(out),
                 "--quiet"]) == 0
    assert out.read_text(encoding="utf-8").splitlines() == hyps

    namespace: dict = {}
    code = readme_python().replace("runs/multi30k-en-de", str(run_dir))
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102
    capsys.readouterr()
    assert namespace["hyps"] == hyps

    with gzip.open(data, "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()[:32]
    translator = Translator.from_pretrained(run_dir)
    limits = ServeLimits()
    with serve_in_thread(create_app(translator, limits)) as base:
        r = httpx.post(base + "/translate", json={"lines": lines}, timeout=120)
        info = httpx.get(base + "/info", timeout=30).json()
    assert r.status_code == 200, r.text
    assert r.json()["batch_lines"] == 32
    assert [t[0]["text"] for t in r.json()["translations"]] == translator.translate(
        lines, batch_size=limits.max_batch_lines)
    assert info["ensemble"] == [str(run_dir / m) for m in record["members"]]
    assert (info["precision"], info["decode"]["alpha"]) == (want, results["alpha"])
    # the length_ratio flag's range, made on val's references, travels with the model
    assert record["length_ratio"]["low"] < record["length_ratio"]["high"]
    assert info["length_ratio"] == record["length_ratio"]
