"""train.precision and decoding's --precision (aiayn.precision): the rule, the real probe
deciding as the CPU's bf16 support says, on either CPU class, the GPU's rule by compute
capability (faked on the CPU), and fp16's loss-scaled update run on the CPU."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import aiayn.precision as precision
from aiayn.checkpoint import load_training_state
from aiayn.config import Config, DataConfig, DecodeConfig, ModelConfig, TrainConfig, load_config
from aiayn.data.batching import encode_corpus
from aiayn.data.splits import load_split
from aiayn.data.vocab import Vocabulary
from aiayn.devices import set_tf32
from aiayn.errors import ConfigError
from aiayn.precision import (Precision, choose_precision, default_decoding_precision,
                             gpu_precision, may_reduce_decoding_precision, probe_cpu,
                             resumed_precision)
from aiayn.training.loop import Trainer
from aiayn.training.update import MIN_LOSS_SCALE

MODEL = load_config("multi30k").model


@pytest.mark.parametrize("rates, training, chosen", [
    ((100.0, 400.0), True, "bf16-weights"), ((100.0, 400.0), False, "bf16"),
    ((100.0, 110.0), True, "fp32"),  # faster, but not by BF16_MIN_SPEEDUP
    ((100.0, 5.0), True, "fp32"), ((100.0, 5.0), False, "fp32")])
def test_auto_takes_bf16_only_where_the_probe_finds_it_clearly_faster(monkeypatch, rates,
                                                                       training, chosen):
    monkeypatch.setattr(precision, "probe_cpu", lambda model, rows: rates)
    monkeypatch.setattr(precision, "probe_int8_step", lambda model: 0.8)  # int8 slow here
    got = choose_precision("auto", "cpu", MODEL, training=training)
    assert got.chosen == chosen and (got.fp32_gflops, got.bf16_gflops) == rates
    assert got.uses_bf16 == (chosen != "fp32")
    assert f"bf16 {rates[1]:.1f} and fp32 {rates[0]:.1f}" in got.describe() if not training \
        else f"bf16 {rates[1]:.1f} against fp32 {rates[0]:.1f}" in got.describe()


@pytest.mark.parametrize("bf16, int8, chosen", [
    (400.0, 3.0, "int8"),
    (400.0, 1.3, "int8"),  # bf16 products faster, but the int8 step beats fp32's: int8 first
    (400.0, 1.1, "bf16"),  # the int8 step not clearly faster than fp32's: bf16
    (50.0, 1.3, "int8"), (50.0, 1.1, "fp32"), (110.0, 1.1, "fp32")])
def test_decoding_auto_takes_int8_where_it_beats_fp32_then_bf16(monkeypatch, bf16, int8,
                                                                chosen):
    monkeypatch.setattr(precision, "probe_cpu", lambda model, rows: (100.0, bf16))
    monkeypatch.setattr(precision, "probe_int8_step", lambda model: int8)
    got = choose_precision("auto", "cpu", MODEL, training=False)
    assert got.chosen == chosen and got.int8_speedup == int8
    assert got.uses_int8 == (chosen == "int8") and not (got.uses_int8 and got.uses_bf16)
    assert choose_precision("auto", "cpu", MODEL, training=True).chosen != "int8"


def test_int8_is_a_cpu_decoding_precision():
    assert choose_precision("int8", "cpu", MODEL, training=False).chosen == "int8"
    with pytest.raises(ValueError, match="'int8': expected one of auto, fp32, bf16, "
                                         "bf16-weights"):
        choose_precision("int8", "cpu", MODEL, training=True)


def test_an_explicit_precision_is_kept_and_a_slow_bf16_is_said(monkeypatch):
    monkeypatch.setattr(precision, "probe_cpu", lambda model, rows: (100.0, 5.0))
    got = choose_precision("bf16-weights", "cpu", MODEL)
    assert got.chosen == "bf16-weights" and "20x slower than fp32" in got.reason
    monkeypatch.setattr(precision, "probe_cpu", lambda model, rows: pytest.fail("probed"))
    assert choose_precision("fp32", "cpu", MODEL).chosen == "fp32"  # no probe for fp32
    with pytest.raises(ValueError, match="'bf16-weights': expected one of auto, fp32, bf16"):
        choose_precision("bf16-weights", "cpu", MODEL, training=False)


@pytest.mark.parametrize("now, recorded, device, kept", [
    (Precision("auto", "fp32", "", 100.0, 110.0), "bf16-weights", "cpu", True),  # noise
    (Precision("auto", "bf16-weights", "", 100.0, 400.0), "fp32", "cpu", True),
    (Precision("auto", "fp32", "", 100.0, 5.0), "bf16-weights", "cpu", False),  # emulated bf16
    (Precision("auto", "bf16-weights", "", 100.0, 400.0), "bf16", "cuda", False),  # moved
    (Precision("auto", "fp32", "", 100.0, 110.0), None, None, False),  # an older checkpoint
    (Precision("fp32", "fp32", "as asked"), "bf16-weights", "cpu", False)])  # asked for
def test_a_resumed_run_keeps_its_recorded_precision_unless_the_machine_changed(now, recorded,
                                                                               device, kept):
    got = resumed_precision(now, recorded, device, "cpu")
    assert got.chosen == (recorded if kept else now.chosen)
    assert ("kept from the checkpoint" in got.reason) == kept
    assert (got.fp32_gflops, got.bf16_gflops) == (now.fp32_gflops, now.bf16_gflops)


def test_the_probe_takes_the_fastest_call():
    """Slow calls (another process woke up) do not decide the rate: the fastest does. The
    timed calls take about 400, 200 and 0 ms: their mean and their median are 200 ms, the
    fastest under 1 ms (a busy machine may add tens), so a probe that took either of the
    others would fail here."""
    calls = iter([0.0, 0.4, 0.2, 0.0])  # the untimed warm-up call, then three timed

    def fn():
        import time
        time.sleep(next(calls))

    assert precision._seconds_per_call(fn, budget_s=0.0, max_calls=10, min_calls=3) < 0.1
    with pytest.raises(StopIteration):  # exactly three calls were timed
        next(calls)


def test_decoding_defaults_to_fp32_unless_a_check_recorded_another():
    assert default_decoding_precision() == "fp32"
    assert default_decoding_precision("auto") == "fp32"
    assert default_decoding_precision("int8") == "int8"
    assert default_decoding_precision("int8", "cuda") == "fp32"  # int8 is a CPU choice
    assert not may_reduce_decoding_precision("fp32")
    assert all(may_reduce_decoding_precision(p) for p in ("auto", "bf16", "bf16-weights"))


def test_the_real_probe_decides_and_emulated_bf16_never_wins():
    """auto trains on bf16 weights exactly when the probe measured bf16 products
    BF16_MIN_SPEEDUP times faster than fp32 on this CPU. Where bf16 is emulated (the AVX2
    class, real or simulated with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2) it is
    5-45x slower, so fp32 is chosen. Native bf16 is not always faster: on the Zen 4 class it
    ran 4-5x faster, on an Intel Xeon (family 6, model 207, no AMX) 0.56x on one thread, which
    is why the choice is measured, not read from the CPU's flags."""
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    fp32, bf16 = probe_cpu(MODEL)
    assert fp32 > 0 and bf16 > 0
    if not native:
        assert bf16 < fp32, (fp32, bf16)
    want = "bf16-weights" if bf16 >= precision.BF16_MIN_SPEEDUP * fp32 else "fp32"
    assert choose_precision("auto", "cpu", MODEL).chosen == want, (fp32, bf16)


def test_the_decoding_probe_times_a_real_step_and_leaves_the_callers_random_stream():
    """probe_int8_step decodes a few cached steps of the model's shape in fp32 and on its
    int8 copy: a positive, finite ratio, kept for the process (the same value again), and
    the caller's torch random stream continues as if no probe had run."""
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    speedup = precision.probe_int8_step(MODEL)
    assert torch.equal(torch.rand(3), want)
    assert 0.0 < speedup < float("inf")
    assert precision.probe_int8_step(MODEL) == speedup
    got = choose_precision("auto", "cpu", MODEL, training=False)
    assert got.int8_speedup == round(speedup, 2)
    assert f"int8 decoder step {speedup:.2f}x as fast as fp32's" in got.reason
    assert (got.chosen == "int8") == (speedup >= precision.INT8_MIN_SPEEDUP)


# --- on a GPU: the compute capability decides ------------------------------------------------

@pytest.mark.parametrize("capability, training, chosen, tf32", [
    ((7, 0), True, "fp16", False),   # V100: bf16 emulated; fp16 tensor cores
    ((7, 5), True, "fp16", False),   # T4
    ((6, 0), True, "fp16", False),   # P100: fp16 at twice fp32's rate
    ((6, 1), True, "fp32", False),   # P40: fp16 at 1/64 of fp32's rate
    ((8, 0), True, "bf16", True),    # A100
    ((8, 6), True, "bf16", True),
    ((9, 0), True, "bf16", True),    # H100
    ((7, 0), False, "fp32", False),  # decoding has no fp16; nor TF32
    ((8, 0), False, "bf16", False)])
def test_auto_on_a_gpu_follows_its_compute_capability(capability, training, chosen, tf32):
    got = gpu_precision("auto", capability, training=training, name="GPU")
    assert (got.chosen, got.tf32, got.loss_scaling) == (chosen, tf32, chosen == "fp16")
    assert got.capability == f"{capability[0]}.{capability[1]}"
    assert f"GPU (compute capability {got.capability})" in got.reason
    assert ("GradScaler" in got.reason) == got.loss_scaling
    assert ("TF32" in got.reason) == tf32


def test_an_explicit_precision_on_a_gpu_is_kept_and_a_missing_ability_is_said():
    assert gpu_precision("fp32", (8, 6)).tf32  # fp32 products in TF32 from 8.0...
    full = gpu_precision("fp32", (8, 6), tf32=False)  # ... unless train.tf32 is false
    assert not full.tf32 and "full float32 (train.tf32 false)" in full.reason
    assert not gpu_precision("fp32", (7, 5)).tf32  # no TF32 before Ampere
    emulated = gpu_precision("bf16", (7, 0))
    assert emulated.chosen == "bf16" and "torch emulates bf16" in emulated.reason
    fp16 = gpu_precision("fp16", (9, 0))
    assert fp16.chosen == "fp16" and fp16.loss_scaling and fp16.tf32
    assert "slower than fp32" in gpu_precision("fp16", (6, 1)).reason
    with pytest.raises(ValueError, match="'fp16': expected one of auto, fp32, bf16, int8"):
        gpu_precision("fp16", (8, 0), training=False)
    with pytest.raises(ConfigError, match="int8 is a CPU decoding path"):
        gpu_precision("int8", (8, 0), training=False)


def test_choose_precision_reads_the_capability_not_is_bf16_supported(monkeypatch):
    """A faked GPU on the CPU: torch's queries stood in for. is_bf16_supported() says yes on a
    V100 since torch 2.4 (emulation); the capability says 7.0, so fp16 with a scaler."""
    model = load_config("base").model
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    v100 = choose_precision("auto", "cuda:0", model)
    assert v100.to_dict() == {**v100.to_dict(), "chosen": "fp16", "loss_scaling": True,
                              "tf32": False, "capability": "7.0"}
    assert "Tesla V100 (compute capability 7.0)" in v100.describe()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    a100 = choose_precision("auto", "cuda:0", model)
    assert (a100.chosen, a100.loss_scaling, a100.tf32, a100.capability) == \
        ("bf16", False, True, "8.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    fp32 = choose_precision("fp32", "cuda:0", model)
    assert (fp32.chosen, fp32.tf32) == ("fp32", True)
    assert not choose_precision("fp32", "cuda:0", model, tf32=False).tf32
    # what the run records: metrics.jsonl's precision line and train_summary.json
    assert json.loads(json.dumps(fp32.to_dict()))["tf32"] is True


@pytest.mark.parametrize("recorded, now, kept", [
    ("bf16", gpu_precision("auto", (7, 0)), False),  # resumed on a V100: no emulated bf16
    ("fp16", gpu_precision("auto", (8, 0)), True),   # fp16 runs on an A100: one precision
    ("bf16", gpu_precision("auto", (9, 0)), True)])
def test_a_resumed_gpu_run_drops_bf16_on_a_gpu_without_it(recorded, now, kept):
    got = resumed_precision(now, recorded, "cuda", "cuda")
    assert got.chosen == (recorded if kept else now.chosen)
    assert (got.tf32, got.capability) == (now.tf32, now.capability)  # this GPU's


def test_set_tf32_sets_the_matmul_precision_for_the_process():
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("torch before 2.9: allow_tf32 only")
    before = matmul.fp32_precision
    try:
        set_tf32(True)
        assert matmul.fp32_precision == "tf32"
        set_tf32(False)
        assert matmul.fp32_precision == "ieee"
    finally:
        matmul.fp32_precision = before


# --- fp16's update with a loss scale, run on the CPU ------------------------------------------

def _copy_task(folder: Path, **train: object) -> tuple[Config, Vocabulary, object]:
    """A one-layer model on 200 copy pairs: a few updates take well under a second."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1)
    lines = [" ".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 8)))
             for _ in range(200)]
    for side in ("src", "tgt"):
        (folder / f"train.{side}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    data = DataConfig(dataset="files", train_src=str(folder / "train.src"),
                      train_tgt=str(folder / "train.tgt"), vocab_size=40, max_tokens=256,
                      max_len=32)
    model = ModelConfig(N=1, d_model=32, d_ff=64, h=4, d_k=8, d_v=8, P_drop=0.0,
                        vocab_size=40, max_len=64)
    settings = dict(warmup_steps=20, lr_scale=2.0, max_steps=4, checkpoint_every_s=0,
                    checkpoint_every_steps=2, keep_last=3, eval_every_steps=100,
                    eval_bleu_sentences=0, log_every_steps=1, precision="fp16")
    settings.update(train)
    cfg = Config(name="copy", model=model, data=data, train=TrainConfig(**settings),
                 decode=DecodeConfig(beam_size=1, max_len_b=8))
    corpus = load_split(cfg.data, "train")
    vocab = Vocabulary.learn(corpus.src + corpus.tgt, 40)
    cfg = cfg.replace(model=replace(cfg.model, vocab_size=len(vocab)))
    return cfg, vocab, encode_corpus(vocab, corpus, 32)


def test_fp16_trains_with_a_loss_scale_on_the_cpu_and_keeps_it_in_checkpoints(tmp_path):
    """torch.amp.GradScaler("cpu") runs the same update as on a GPU: the loss scaled, the
    gradient unscaled before clipping, the step taken, the scale saved for a resume. Its
    losses follow fp32's (float16 rounding apart) from the same start."""
    losses = {}
    for name in ("fp32", "fp16"):
        cfg, vocab, train = _copy_task(tmp_path / "data", precision=name, clip_norm=1.0)
        trainer = Trainer(cfg, tmp_path / name, vocab, train, progress=False)
        summary = trainer.fit()
        assert summary["steps"] == 4 and summary["nonfinite_total"] == 0
        assert summary["precision"]["loss_scaling"] == (name == "fp16")
        records = [json.loads(line) for line in
                   (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in records if r["kind"] == "train"]
        scales = [r.get("loss_scale") for r in records if r["kind"] == "train"]
        assert scales == ([2.0**16] * 4 if name == "fp16" else [None] * 4)
        state = load_training_state(tmp_path / name / "checkpoints" / "step-00000004")
        assert ("scaler" in state) == (name == "fp16")
    assert losses["fp16"] == pytest.approx(losses["fp32"], rel=1e-2)
    assert state["scaler"]["scale"] == 2.0**16 and state["precision"] == "fp16"


def test_an_fp16_overflow_skips_the_update_and_halves_the_scale(tmp_path):
    cfg, vocab, train = _copy_task(tmp_path / "data")
    trainer = Trainer(cfg, tmp_path / "run", vocab, train, progress=False)
    learner = trainer.learner
    learner.scaler.load_state_dict({**learner.scaler.state_dict(), "scale": 2.0**60})
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    fig = learner.update(trainer.next_batches())  # float16 gradients of 2**60 x the loss: inf
    assert (fig["skipped"], fig["overflow"], fig["loss_scale"]) == (1.0, 1.0, 2.0**60)
    assert learner.scaler.get_scale() == 2.0**59 and learner.state.step == 0
    assert all(torch.equal(before[k], v) for k, v in learner.model.state_dict().items())
    # the loop lets the scaler find its scale: the overflows are not a run of failures
    summary = trainer.fit()
    assert summary["steps"] == 4 and summary["nonfinite_total"] >= 20
    assert cfg.train.max_nonfinite < summary["nonfinite_total"]
    assert MIN_LOSS_SCALE < learner.scaler.get_scale() < 2.0**59
    # a non-finite loss is no overflow: it counts towards train.max_nonfinite
    with torch.no_grad():
        learner.model.tgt_embed.weight[0, 0] = float("inf")
    fig = learner.update(trainer.next_batches())
    assert fig["skipped"] == 1.0 and fig["overflow"] == 0.0


def test_a_resumed_fp16_run_continues_with_its_loss_scale(tmp_path):
    """2 updates, a checkpoint, 2 more on resume: the uninterrupted run's losses and weights,
    the scaler's state (scale and growth tracker) carried by the checkpoint."""
    cfg, vocab, train = _copy_task(tmp_path / "data", max_steps=4)
    whole = Trainer(cfg, tmp_path / "whole", vocab, train, progress=False)
    whole.learner.scaler.load_state_dict({**whole.learner.scaler.state_dict(),
                                          "scale": 2.0**10, "growth_interval": 3})
    whole.fit()
    first = Trainer(cfg.replace(train=replace(cfg.train, max_steps=2)), tmp_path / "cut", vocab,
                    train, progress=False)
    first.learner.scaler.load_state_dict({**first.learner.scaler.state_dict(),
                                          "scale": 2.0**10, "growth_interval": 3})
    first.fit()
    resumed = Trainer(cfg, tmp_path / "cut", vocab, train, progress=False,
                      resume_from=tmp_path / "cut" / "checkpoints" / "step-00000002")
    assert resumed.learner.scaler.state_dict() == first.learner.scaler.state_dict()
    resumed.fit()
    assert whole.learner.scaler.get_scale() == 2.0**11  # grew once, at update 3
    assert resumed.learner.scaler.state_dict() == whole.learner.scaler.state_dict()
    for name, p in whole.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], p, rtol=0, atol=0)


def test_the_probe_interleaves_what_it_compares():
    """A stall that lasts the first calls (another process held the core) must not fall on one
    side of a comparison only: the fp32 and bf16 calls alternate, so each side gets calls
    after the stall. Timed one after the other, the first side's calls would all be slow."""
    calls = []

    def fn(name):
        def call():
            calls.append(name)
            if len(calls) <= 4:  # the stall: the first four calls, whoever makes them
                import time
                time.sleep(0.2)
        return call

    best = precision._fastest_interleaved([fn("fp32"), fn("bf16")], budget_s=0.0)
    assert calls[:4] == ["fp32", "bf16", "fp32", "bf16"]  # warm-ups, then alternating
    assert max(best) < 0.1
