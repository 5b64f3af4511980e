"""The trainer's parts: an injected model, optimizer and metrics sink are the ones used, and
the pad id comes from the vocabulary."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rel_helpers import small_config

from aiayn.data.batching import encode_corpus
from aiayn.data.vocab import Vocabulary
from aiayn.devices import cpu_times, steal_percent
from aiayn.model import Transformer
from aiayn.data.splits import load_split
from aiayn.training.loop import Trainer
from aiayn.training.metrics import MetricsSink, Window
from aiayn.training.update import build_model


class MemorySink(MetricsSink):
    def __init__(self) -> None:
        super().__init__("unused", enabled=False)
        self.records: list[dict] = []

    def log(self, record: dict) -> None:
        self.records.append(record)


def _setup(tmp_path: Path):
    cfg = small_config(tmp_path / "data", max_steps=4, checkpoint_every_steps=0,
                       eval_every_steps=2, eval_bleu_sentences=2)
    corpus = load_split(cfg.data, "train")
    vocab = Vocabulary.learn(corpus.src + corpus.tgt, 40)
    cfg = cfg.replace(model=replace(cfg.model, vocab_size=len(vocab)))
    return cfg, vocab, encode_corpus(vocab, corpus, 32), load_split(cfg.data, "valid")


def test_injected_model_optimizer_and_sink_are_used(tmp_path: Path) -> None:
    cfg, vocab, train, valid = _setup(tmp_path)
    model = build_model(cfg, torch.device("cpu"), seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    sink = MemorySink()
    trainer = Trainer(cfg, tmp_path / "run", vocab, train, valid,
                      encode_corpus(vocab, valid, 32), progress=False, model=model,
                      optimizer=optimizer, metrics=sink)
    summary = trainer.fit()
    assert trainer.model is model and trainer.learner.optimizer is optimizer
    assert summary["steps"] == 4
    assert [r["step"] for r in sink.records if r["kind"] == "train"] == [1, 2, 3, 4]
    assert [r["step"] for r in sink.records if r["kind"] == "valid"] == [2, 4]
    if cpu_times() is not None:  # Linux: every train record says how much the host stole
        assert all("cpu_steal_pct" in r for r in sink.records if r["kind"] == "train")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # the sink got them instead
    assert all(g["lr"] > 0 for g in optimizer.param_groups)  # the §5.3 schedule drove it
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_pad_id_must_be_the_vocabularys(tmp_path: Path) -> None:
    cfg, vocab, train, _ = _setup(tmp_path)
    bad = cfg.replace(model=replace(cfg.model, pad_id=3))
    with pytest.raises(ValueError, match="pad_id=3"):
        Trainer(bad, tmp_path / "run", vocab, train, progress=False,
                model=Transformer(bad.model))


def test_cpu_times_reads_the_steal_column_of_proc_stat(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    # a line of a real /proc/stat (Linux 6.x): user nice system idle iowait irq softirq steal
    # guest guest_nice; guest time is already inside user, so it is not added again
    stat.write_text("cpu  10935567 7772 602914 2502354 15804 0 12205 410980 55 7\n"
                    "cpu0 5467783 3886 301457 1251177 7902 0 6102 205490 0 0\n")
    assert cpu_times(str(stat)) == (410980, 10935567 + 7772 + 602914 + 2502354 + 15804
                                    + 12205 + 410980)
    stat.write_text("cpu  1 2 3 4\n")  # too old a kernel to report steal
    assert cpu_times(str(stat)) is None
    stat.write_text("cpu  1 2 3 4 5 6 7 x 9\n")  # not numbers: no figure, no exception
    assert cpu_times(str(stat)) is None
    assert cpu_times(str(tmp_path / "missing")) is None


@pytest.mark.skipif(cpu_times() is None, reason="no /proc/stat steal column here")
def test_a_window_shorter_than_a_clock_tick_still_reports_steal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a fast step logged every update can end before /proc/stat counts one tick (CI did):
    # the same reading at both ends of the window
    frozen = cpu_times()
    monkeypatch.setattr("aiayn.training.metrics.cpu_times", lambda: frozen)
    window = Window()
    window.add({"tokens": 10.0, "loss": 2.0, "nll": 1.5})
    record = window.record(step=1, epoch=1, lr=1e-3, elapsed_s=0.0, nonfinite_total=0)
    assert record["cpu_steal_pct"] == 0.0 and record["nll"] == pytest.approx(1.5)


def test_steal_percent_is_the_stolen_share_of_the_interval() -> None:
    assert steal_percent((100, 1000), (400, 2000)) == pytest.approx(30.0)
    assert steal_percent((100, 1000), (100, 1000)) == 0.0  # under a tick: nothing counted
    assert steal_percent(None, (1, 2)) is None and steal_percent((1, 2), None) is None


def test_the_clock_counts_training_time_only() -> None:
    """What runs while the clock is paused (validation, checkpoints) is not training time,
    and neither is an exception's way out of the pause."""
    from aiayn.training.loop import Clock

    now = [100.0]
    clock = Clock(lambda: now[0])
    now[0] = 103.0
    assert clock.tick() == 3.0
    with clock.paused():
        now[0] = 150.0  # a validation
    now[0] = 152.5
    assert clock.tick() == 2.5
    with pytest.raises(OSError), clock.paused():
        now[0] = 160.0
        raise OSError("a full disk while saving")
    now[0] = 161.0
    assert clock.tick() == 1.0
