"""docs/wmt14.md's recipe, command for command, on a 1,000-pair synthetic slice: clean, vocab,
prepare, torchrun train with the base preset's global batch, average, translate, evaluate.

Only the model is shrunk (a tiny override of ``--preset base``) and the steps are few; every
command and option is the document's. The test also checks that the document still holds
these commands, so the two cannot drift apart.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "wmt14.md"

# a model of seconds standing in for base; the data, batch and schedule options are the recipe's
TINY = ["model.N=1", "model.d_model=32", "model.d_ff=64", "model.h=2", "model.d_k=16",
        "model.d_v=16", "train.max_steps=4", "train.warmup_steps=2",
        "train.checkpoint_every_steps=2", "train.checkpoint_every_s=0", "train.precision=fp32",
        "train.eval_every_steps=4", "train.eval_bleu_sentences=0", "train.log_every_steps=1"]


def _synthetic():
    spec = importlib.util.spec_from_file_location("synthetic_corpus",
                                                  ROOT / "bench" / "synthetic_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*argv: str, timeout: int = 300) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("AIAYN_DEBUG", None)
    res = subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_the_document_names_the_commands_this_test_runs():
    text = DOC.read_text(encoding="utf-8")
    for command in ("python -m aiayn.data.clean", "aiayn vocab", "aiayn prepare",
                    "torchrun --nproc-per-node", "--preset base", "data.global_max_tokens=25000",
                    "aiayn average", "aiayn evaluate", "newstest2014"):
        assert command in text, command


@pytest.mark.slow
def test_recipe_end_to_end_on_a_synthetic_slice(tmp_path: Path) -> None:
    synthetic = _synthetic()
    raw = tmp_path / "raw"
    src, tgt = synthetic.write_corpus(raw, 1000, types=5000, data_dir="")
    dev = synthetic.write_corpus(raw, 40, stem="newstest2013", seed=2, types=5000, data_dir="")
    test = synthetic.write_corpus(raw, 40, stem="newstest2014", seed=3, types=5000, data_dir="")
    py = sys.executable
    wmt = tmp_path / "wmt14"
    wmt.mkdir()

    # 1. clean (fairseq's rules)
    out = _run(py, "-m", "aiayn.data.clean", "--src", str(src), "--tgt", str(tgt),
               "--out-src", str(wmt / "train.clean.en"), "--out-tgt",
               str(wmt / "train.clean.de"), "--json")
    counts = json.loads(out)
    assert counts["read"] == 1000 and 0 < counts["kept"] <= 1000
    # 2. the shared vocabulary, learned once from a sample (here half the sentences)
    out = _run(py, "-m", "aiayn", "vocab", "--src", str(wmt / "train.clean.en"), "--tgt",
               str(wmt / "train.clean.de"), "--size", "1000", "--sample-lines",
               str(counts["kept"]), "-o", str(wmt / "vocab"), "--json")
    vocab = json.loads(out)
    assert vocab["pairs_used"] == counts["kept"] // 2 and vocab["round_trip_rate"] == 1.0
    # 3. prepare the cleaned pairs once: memory-mapped token ids every process maps
    out = _run(py, "-m", "aiayn", "prepare", "--src", str(wmt / "train.clean.en"), "--tgt",
               str(wmt / "train.clean.de"), "--vocab", str(wmt / "vocab"), "-o",
               str(wmt / "prepared"), "--json")
    manifest = json.loads(out)
    assert 0 < manifest["counts"]["kept"] <= counts["kept"]
    # 4. train: two processes share the base preset's 25000-token update
    run_dir = tmp_path / "runs" / "wmt14-base"
    data = ["data.dataset=files", f"data.prepared={wmt / 'prepared'}",
            f"data.valid_src={dev[0]}", f"data.valid_tgt={dev[1]}",
            "data.global_max_tokens=25000"]
    sets = [arg for item in data + TINY for arg in ("--set", item)]
    out = _run(py, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(27500 + os.getpid() % 1000), "-m", "aiayn", "train", "--preset", "base",
               "--vocab", str(wmt / "vocab"), "--run-dir", str(run_dir), *sets,
               "--no-progress", "--device", "cpu", timeout=600)
    assert ("global batch 2 process(es) x 1 accumulation step(s) x 12500 tokens = at most "
            "25000 tokens a side an update (data.global_max_tokens = 25000)") in out
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["data"]["max_tokens"], config["data"]["global_max_tokens"]) == (12500, 25000)
    assert json.loads((run_dir / "data.json").read_text())["fingerprint"] == \
        manifest["fingerprint"]
    # 5. average the last checkpoints (§6.1)
    _run(py, "-m", "aiayn", "average", str(run_dir), "--last", "2")
    averaged = run_dir / "averaged"
    # 6. translate and 7. evaluate on the test set
    hyp = tmp_path / "newstest2014.hyp.de"
    _run(py, "-m", "aiayn", "translate", "--checkpoint", str(averaged), "-i", str(test[0]),
         "-o", str(hyp), "--device", "cpu")
    assert len(hyp.read_text(encoding="utf-8").splitlines()) == 40
    out = _run(py, "-m", "aiayn", "evaluate", "--checkpoint", str(averaged), "--src",
               str(test[0]), "--ref", str(test[1]), "--device", "cpu", "--json")
    scores = json.loads(out.strip().splitlines()[-1])
    assert scores["sentences"] == 40
    assert math.isfinite(scores["scores"]["sacrebleu"]["bleu"])
    assert math.isfinite(scores["scores"]["paper"]["bleu"])


def test_global_batch_sets_each_batch_and_is_logged(tmp_path: Path) -> None:
    """One process accumulating 2 batches under data.global_max_tokens = 2048: each batch is
    1024 tokens a side, the run says so at start, and its config.json records the 1024."""
    from aiayn.config import load_config
    from aiayn.training.run import run_training

    src, tgt = _synthetic().write_corpus(tmp_path / "raw", 200, types=2000, data_dir="")
    config = load_config("tiny", ["data.dataset=files", f"data.train_src={src}",
                                  f"data.train_tgt={tgt}", "data.global_max_tokens=2048",
                                  "data.max_tokens=0", "data.vocab_size=300",
                                  "train.accum_steps=2", "train.max_steps=2",
                                  "train.checkpoint_every_steps=0", "train.eval_every_steps=100"])
    lines: list[str] = []
    run_training(config, tmp_path / "run", progress=False, log=lines.append)
    assert ("aiayn train: global batch 1 process(es) x 2 accumulation step(s) x 1024 tokens = "
            "at most 2048 tokens a side an update (data.global_max_tokens = 2048)") in lines
    assert any("learned from all of 200 pairs" in line for line in lines)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["data"]
    assert (saved["max_tokens"], saved["global_max_tokens"]) == (1024, 2048)


@pytest.mark.slow
def test_pipeline_takes_a_test_set_as_files(tmp_path: Path, capsys) -> None:
    """A dataset of files names no test split: ``--test-src``/``--test-tgt`` give it one (the
    recipe's newstest2014), translated once and scored against its references."""
    from aiayn.cli import main

    synthetic = _synthetic()
    src, tgt = synthetic.write_corpus(tmp_path, 300, types=2000, data_dir="")
    dev = synthetic.write_corpus(tmp_path, 20, stem="dev", seed=2, types=2000, data_dir="")
    test = synthetic.write_corpus(tmp_path, 25, stem="test", seed=3, types=2000, data_dir="")
    sets = ["data.dataset=files", f"data.train_src={src}", f"data.train_tgt={tgt}",
            f"data.valid_src={dev[0]}", f"data.valid_tgt={dev[1]}", "data.vocab_size=300",
            "train.max_steps=6", "train.checkpoint_every_steps=3", "train.eval_every_steps=6"]
    code = main(["pipeline", "--preset", "tiny", "--run-dir", str(tmp_path / "run"),
                 "--no-progress", "--json", "--average", "2", "--test-src", str(test[0]),
                 "--test-tgt", str(test[1]), *[a for s in sets for a in ("--set", s)]])
    assert code == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results["test_set"] == "test.en" and math.isfinite(results["sacrebleu_bleu"])
    hyps = (tmp_path / "run" / "test.hyp.de").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == 25
