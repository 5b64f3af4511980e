"""The main job through the CLI on a slice of Multi30k (issue: the end-to-end job). CI runs this
instead of the full hour: every artefact appears, the loss falls well below its start, and the
test translations are line-aligned with the source."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from aiayn.cli import main


def test_pipeline_on_a_multi30k_slice(data_dir: Path, tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    job = ["pipeline", "--preset", "tiny", "--run-dir", str(run_dir), "--no-progress",
           "--set", "decode.batch_size=250", "--json"]
    code = main(job + ["--set", "data.train_limit=4000", "--set", "train.max_steps=240",
                       "--set", "train.lr_scale=1.0", "--set", "train.checkpoint_every_steps=60",
                       "--set", "train.eval_every_steps=120", "--average", "3", "1"])
    assert code == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    # each averaging width was scored on val; the better one is the model on disk that
    # translated the test set
    by_average = results["valid_bleu_by_average"]
    assert set(by_average) == {"3", "1"} and all(set(v) == {"0.6"} for v in by_average.values())
    width = max(("3", "1"), key=lambda k: by_average[k]["0.6"])
    assert results["valid_bleu_by_alpha"] == by_average[width]
    assert results["averaged"] == ["step-00000120", "step-00000180", "step-00000240"][-int(width):]
    meta = json.loads((run_dir / "averaged" / "meta.json").read_text())
    assert [Path(p).name for p in meta["averaged_from"]] == results["averaged"]

    for name in ("config.json", "tokenizer.json", "metrics.jsonl", "train_summary.json",
                 "results.json", "curves.png", "test.hyp.de", "averaged/model.safetensors",
                 "best/model.safetensors"):
        assert (run_dir / name).is_file(), name
    assert [p.name for p in sorted((run_dir / "checkpoints").iterdir())] == \
        ["step-00000120", "step-00000180", "step-00000240"]
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    train = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in train if r["kind"] == "train"]
    assert losses[-1] < 0.7 * losses[0], (losses[0], losses[-1])
    assert any(r["kind"] == "valid" and "valid_bleu" in r for r in train)

    with gzip.open(data_dir / "multi30k" / "test_2016_flickr.en.gz", "rt") as f:
        n_src = len(f.read().splitlines())
    hyps = (run_dir / "test.hyp.de").read_text(encoding="utf-8").split("\n")
    assert hyps[-1] == "" and len(hyps) - 1 == n_src == 1000
    for key in ("sacrebleu_bleu", "sacrebleu_chrf", "multi30k_tok_bleu"):
        assert 0.0 <= results[key] <= 100.0
    if Path("/proc/stat").exists():  # Linux: how much of training the host took
        assert 0.0 <= results["train_cpu_steal_pct"] <= 100.0
    assert results["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert results["multi30k_tok_reference"].endswith("test_2016_flickr.lc.norm.tok.de.gz")

    # the same finished run, resumed with the widths in the other order: training has nothing
    # left to do (the run's config.json keeps its 240 steps), val scores the same weights
    # again, and the width chosen is the same one. Unless the two widths tie on val, the
    # winner comes last in one order (the loop's average is the one on disk) and not in the
    # other (it is averaged again), so both paths translate the test set.
    code = main(job + ["--resume", "--average", "1", "3"])
    assert code == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["train_steps"] == 240 and again["valid_bleu_by_average"] == by_average
    if by_average["3"] != by_average["1"]:  # a tie goes to the first given: 1 here, 3 above
        assert again["averaged"] == results["averaged"]
        assert again["multi30k_tok_bleu"] == results["multi30k_tok_bleu"]
    meta = json.loads((run_dir / "averaged" / "meta.json").read_text())
    assert [Path(p).name for p in meta["averaged_from"]] == again["averaged"]
