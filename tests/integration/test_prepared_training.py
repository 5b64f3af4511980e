"""Training on a prepared corpus: `aiayn train --set data.prepared=DIR`, the fingerprint a run
records, and a resume on other data refused naming what changed."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from aiayn.config import Config, DataConfig, DecodeConfig, ModelConfig, TrainConfig
from aiayn.data.prepared import Settings, prepare
from aiayn.rundir import DATA_RECORD
from aiayn.data.vocab import Vocabulary
from aiayn.errors import UserError
from aiayn.training.run import run_training

LETTERS = list("abcdefghij")


def write_files(folder: Path, n: int = 400, seed: int = 1) -> tuple[Path, Path]:
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 8))) for _ in range(n)]
    src, tgt = folder / "train.src", folder / "train.tgt"
    src.write_text("\n".join(lines) + "\n")
    tgt.write_text("\n".join(lines) + "\n")
    return src, tgt


def config(src: Path, tgt: Path, **data) -> Config:
    d = DataConfig(dataset="files", train_src=str(src), train_tgt=str(tgt), vocab_size=40,
                   max_tokens=256, max_len=32, **data)
    return Config(name="t", model=ModelConfig(N=1, d_model=32, d_ff=64, h=2, d_k=16, d_v=16,
                                              P_drop=0.0, vocab_size=40, max_len=64),
                  data=d, train=TrainConfig(warmup_steps=10, max_steps=6, checkpoint_every_s=0,
                                            checkpoint_every_steps=3, eval_every_steps=1000,
                                            eval_bleu_sentences=0, log_every_steps=1,
                                            precision="fp32"),
                  decode=DecodeConfig(beam_size=1))


def losses(run: Path) -> list[float]:
    rows = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in rows if r["kind"] == "train"]


def quiet(_msg: str) -> None:
    pass


def test_a_prepared_folder_trains_as_its_raw_files_do(tmp_path, monkeypatch):
    src, tgt = write_files(tmp_path)
    cfg = config(src, tgt)
    run_training(cfg, tmp_path / "raw", progress=False, log=quiet)
    vocab = Vocabulary.load(tmp_path / "raw")
    prepare(src, tgt, vocab, tmp_path / "prep", Settings(max_len=32))
    monkeypatch.chdir(tmp_path)  # data.prepared relative to it, recorded absolute
    prepared = cfg.replace(data=replace(cfg.data, dataset="files", train_src=None,
                                        train_tgt=None, prepared="prep"))
    run_training(prepared, tmp_path / "run", progress=False, log=quiet)  # its vocabulary
    assert losses(tmp_path / "run") == losses(tmp_path / "raw")
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["data"]["prepared"] == str(tmp_path / "prep")
    record = json.loads((tmp_path / "run" / DATA_RECORD).read_text())
    assert record == {**record, "fingerprint": json.loads(
        (tmp_path / "raw" / DATA_RECORD).read_text())["fingerprint"]}
    for key, value in (("preprocess", "lc-norm-tok"), ("max_len", 16)):
        bad = prepared.replace(data=replace(prepared.data, **{key: value}))
        with pytest.raises(UserError, match=rf"prepared with {key}.*data\.{key}"):
            run_training(bad, tmp_path / "run3", progress=False, log=quiet)
    other = Vocabulary.learn(["klm nop qrs"] * 20, 30, "bpe")
    other.save(tmp_path / "other")
    with pytest.raises(UserError, match="is not the one .* was prepared with"):
        run_training(prepared, tmp_path / "run2", vocab_path=tmp_path / "other",
                     progress=False, log=quiet)


def test_resume_on_changed_data_is_refused_naming_the_change(tmp_path):
    src, tgt = write_files(tmp_path)
    run_training(config(src, tgt), tmp_path / "run", progress=False, log=quiet)
    write_files(tmp_path, seed=2)  # the same file names, other sentences
    with pytest.raises(UserError, match=r"not the data .* started with \(the source file "
                                        r"\(train\.src\) changed.*the target file"):
        run_training(None, tmp_path / "run", resume=True, overrides=["train.max_steps=9"],
                     progress=False, log=quiet)
    write_files(tmp_path, seed=1)  # back as it was: the resume goes on
    run_training(None, tmp_path / "run", resume=True, overrides=["train.max_steps=9"],
                 progress=False, log=quiet)
    assert len(losses(tmp_path / "run")) == 9


@pytest.mark.parametrize("workers", [0, 1])
def test_a_resume_from_a_prepared_corpus_continues_the_same_batches(tmp_path, monkeypatch,
                                                                    workers):
    """A loader's worker (an accelerator's way; forced here on the CPU) reads ahead; the
    position saved is the batch trained on."""
    from aiayn.training import stream

    monkeypatch.setattr(stream, "loader_workers", lambda _device: workers)
    src, tgt = write_files(tmp_path)
    cfg = config(src, tgt)
    full = cfg.replace(train=replace(cfg.train, max_steps=9))
    run_training(full, tmp_path / "full", progress=False, log=quiet)
    run_training(cfg, tmp_path / "split", progress=False, log=quiet)  # 6 steps
    run_training(None, tmp_path / "split", resume=True, overrides=["train.max_steps=9"],
                 progress=False, log=quiet)
    assert losses(tmp_path / "split") == losses(tmp_path / "full")
