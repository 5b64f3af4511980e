"""The budgeted recipe (issue: the hour): learning-rate schedules that decay to zero at the
budget, the chunked label-smoothed loss with its gradient scale, bf16 compute weights with
float32 masters, and the Multi30k literature's lowercased, normalized, tokenized text."""

from __future__ import annotations

import gzip
import io
import json
import math
from contextlib import redirect_stdout
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_training import task_config  # tests/integration is on sys.path

from aiayn.cli import main
from aiayn.config import DataConfig, TrainConfig, load_config
from aiayn.data.batching import encode_corpus
from aiayn.data.splits import load_split
from aiayn.data.vocab import Vocabulary
from aiayn.training.loop import Trainer
from aiayn.training.loss import label_smoothed_loss
from aiayn.training.schedule import learning_rate, peak_learning_rate, scheduled_lr

# --- schedules ---------------------------------------------------------------------------------


def test_the_default_schedule_is_eq3() -> None:
    tc = TrainConfig(warmup_steps=400, lr_scale=0.7)
    assert tc.lr_schedule == "inverse_sqrt"
    for step in (1, 17, 399, 400, 401, 5000):
        assert scheduled_lr(tc, 256, step, 123.0) == learning_rate(step, 256, 400, 0.7)
    assert peak_learning_rate(tc, 256) == pytest.approx(learning_rate(400, 256, 400, 0.7))


def test_peak_lr_replaces_eq3s_peak() -> None:
    tc = TrainConfig(warmup_steps=100, peak_lr=5e-3)
    assert scheduled_lr(tc, 128, 100, 0.0) == pytest.approx(5e-3)
    assert scheduled_lr(tc, 128, 50, 0.0) == pytest.approx(2.5e-3)  # linear warmup
    assert scheduled_lr(tc, 128, 400, 0.0) == pytest.approx(2.5e-3)  # inverse square root


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_decay_reaches_zero_when_the_step_budget_ends(schedule: str) -> None:
    tc = TrainConfig(lr_schedule=schedule, warmup_steps=100, peak_lr=1e-3, max_steps=1000)
    lrs = [scheduled_lr(tc, 256, s, 0.0) for s in range(1, 1001)]
    top = max(lrs)
    at = 99 / 1000  # progress when warmup ends
    f = (1 - at) if schedule == "linear" else (1 + math.cos(math.pi * at)) / 2
    assert lrs.index(top) == 99 and top == pytest.approx(1e-3 * f)
    after = lrs[99:]
    assert all(b <= a for a, b in zip(after, after[1:]))  # never rises after warmup
    assert lrs[-1] < 1e-3 * 0.002
    half = scheduled_lr(tc, 256, 501, 0.0)
    assert half == pytest.approx(0.5e-3)  # linear: 1 - 0.5; cosine: (1 + cos(pi/2)) / 2


@pytest.mark.parametrize("schedule, at_half", [("linear", 0.5), ("cosine", 0.5)])
def test_the_time_budget_drives_the_decay(schedule: str, at_half: float) -> None:
    tc = TrainConfig(lr_schedule=schedule, warmup_steps=10, peak_lr=2e-3, max_steps=10**6,
                     time_budget_s=100.0)
    assert scheduled_lr(tc, 256, 200, 50.0) == pytest.approx(2e-3 * at_half)
    assert scheduled_lr(tc, 256, 200, 100.0) == 0.0
    assert scheduled_lr(tc, 256, 200, 250.0) == 0.0  # past the budget: stays at zero
    q = scheduled_lr(tc, 256, 200, 25.0) / 2e-3
    assert q == pytest.approx(0.75 if schedule == "linear" else (1 + math.cos(math.pi / 4)) / 2)


@pytest.mark.parametrize("field, value, match", [
    ("lr_schedule", "step", "lr_schedule"), ("peak_lr", -1e-3, "peak_lr"),
    ("precision", "fp8", "precision must be one of")])
def test_bad_schedule_settings_are_refused(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{field: value})


def test_bad_preprocess_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="preprocess"):
        DataConfig(preprocess="lowercase")
    with pytest.raises(ValueError, match="preprocess"):
        load_config("multi30k", ["data.preprocess=moses"])


# --- the loss ------------------------------------------------------------------------------------

@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_chunked_loss_and_gradient_scale_match_torch(eps: float) -> None:
    # a vocabulary of 2^14 + 3 makes chunks of 63 rows: 200 rows take four of them
    torch.manual_seed(3)
    vocab = 2**14 + 3
    logits = torch.randn(200, vocab, dtype=torch.float64, requires_grad=True)
    target = torch.randint(1, vocab, (200,))
    loss, nll, n = label_smoothed_loss(logits, target, eps, pad_id=0, grad_scale=0.25)
    loss.backward()
    ours = logits.grad.clone()
    logits.grad = None
    ref = F.cross_entropy(logits, target, label_smoothing=eps, reduction="sum")
    ref_nll = F.cross_entropy(logits, target, reduction="sum")
    (0.25 * ref).backward()
    assert n == 200
    # the loss itself is unscaled
    assert loss.item() == pytest.approx(ref.item(), rel=1e-10)
    assert nll.item() == pytest.approx(ref_nll.item(), rel=1e-10)
    assert torch.allclose(ours, logits.grad, atol=1e-14)
    # a scaled backward on top multiplies again; without a gradient nothing is kept
    logits.grad = None
    loss, _, _ = label_smoothed_loss(logits, target, eps, pad_id=0, grad_scale=0.25)
    (4.0 * loss).backward()
    assert torch.allclose(logits.grad, 4.0 * ours, atol=1e-13)
    with torch.no_grad():
        plain, _, _ = label_smoothed_loss(logits, target, eps, pad_id=0)
    assert plain.item() == pytest.approx(ref.item(), rel=1e-10)


def test_loss_of_no_tokens_is_zero() -> None:
    logits = torch.randn(0, 11, requires_grad=True)
    loss, nll, n = label_smoothed_loss(logits, torch.zeros(0, dtype=torch.long), 0.1, pad_id=0)
    loss.backward()
    assert (loss.item(), nll.item(), n) == (0.0, 0.0, 0) and logits.grad.shape == (0, 11)


# --- bf16 compute weights ---------------------------------------------------------------------------

def _trainer(folder: Path, **train: object) -> Trainer:
    folder.mkdir()
    cfg = task_config(folder, **train)
    corpus = load_split(cfg.data, "train")
    vocab = Vocabulary.learn(corpus.src + corpus.tgt, 40)
    enc = encode_corpus(vocab, corpus, cfg.data.max_len)
    cfg = cfg.replace(model=replace(cfg.model, vocab_size=len(vocab)))
    return Trainer(cfg, folder / "run", vocab, enc, progress=False)


def test_bf16_weights_train_a_bf16_copy_of_float32_masters(tmp_path: Path) -> None:
    kw = dict(lr_schedule="linear", peak_lr=3e-3, warmup_steps=10, max_steps=30)
    torch.manual_seed(0)
    pure = _trainer(tmp_path / "a", precision="bf16-weights", **kw)
    torch.manual_seed(0)
    autocast = _trainer(tmp_path / "b", precision="bf16", **kw)
    assert autocast.learner.compute_model is autocast.model
    losses = {"pure": [], "autocast": []}
    for step in range(1, 31):
        for name, t in (("pure", pure), ("autocast", autocast)):
            fig = t.learner.update(t.next_batches())
            losses[name].append(fig["loss"])
            assert fig["lr"] == scheduled_lr(t.learner.tc, 64, step, 0.0)
    for master, work in zip(pure.model.parameters(), pure.learner.compute_model.parameters()):
        assert master.dtype == torch.float32 and work.dtype == torch.bfloat16
        assert torch.equal(work, master.detach().to(torch.bfloat16))
    assert pure.learner.optimizer.param_groups[0]["params"][0] is next(pure.model.parameters())
    assert losses["pure"][-1] < 0.7 * losses["pure"][0]
    assert losses["pure"][-1] == pytest.approx(losses["autocast"][-1], rel=0.05)
    path = pure.checkpointer.save(pure.learner)
    from safetensors.torch import load_file

    assert all(t.dtype == torch.float32 for t in load_file(str(path / "model.safetensors"))
               .values())


# --- the Multi30k literature's text -------------------------------------------------------------------

def test_lc_norm_tok_text_is_the_shipped_references(data_dir: Path) -> None:
    d = DataConfig(preprocess="lc-norm-tok")
    test = load_split(d, "test")
    with gzip.open(data_dir / "multi30k/tok/test_2016_flickr.lc.norm.tok.de.gz", "rt",
                   encoding="utf-8") as f:
        assert test.tgt == f.read().splitlines()
    with gzip.open(data_dir / "multi30k/tok/val.lc.norm.tok.en.gz", "rt",
                   encoding="utf-8") as f:
        assert load_split(d, "valid").src == f.read().splitlines()


@pytest.mark.slow
def test_pipeline_and_translate_in_the_literature_text(data_dir: Path, tmp_path: Path,
                                                       capsys) -> None:
    run_dir = tmp_path / "run"
    code = main(["pipeline", "--preset", "tiny", "--run-dir", str(run_dir), "--no-progress",
                 "--set", "data.preprocess=lc-norm-tok", "--set", "data.train_limit=2000",
                 "--set", "train.max_steps=60", "--set", "train.lr_schedule=linear",
                 "--set", "train.peak_lr=3e-3", "--set", "train.warmup_steps=20",
                 "--set", "train.checkpoint_every_steps=30", "--set", "train.eval_every_steps=60",
                 "--set", "decode.beam_size=1", "--set", "decode.max_len_b=5",
                 "--set", "decode.batch_size=500", "--average", "2", "--json"])
    assert code == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results["text"] == "lc-norm-tok" and results["lr_schedule"] == "linear"
    assert results["sacrebleu_bleu"] is None and results["bleu_signature"] is None
    hyps = (run_dir / "test.hyp.de").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == 1000 and all(h == h.lower() for h in hyps)
    from sacrebleu.metrics import BLEU

    with gzip.open(data_dir / "multi30k/tok/test_2016_flickr.lc.norm.tok.de.gz", "rt",
                   encoding="utf-8") as f:
        refs = f.read().splitlines()
    direct = BLEU(tokenize="none", force=True).corpus_score(hyps, [refs]).score
    assert results["multi30k_tok_bleu"] == pytest.approx(direct, abs=0.006)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["data"]["preprocess"] == "lc-norm-tok"

    # aiayn translate applies the model's preprocessing to raw input
    outputs = []
    for text in ("A MAN IS RUNNING.", "a man is running ."):
        src = tmp_path / "in.txt"
        src.write_text(text + "\n", encoding="utf-8")
        buf = io.StringIO()
        with redirect_stdout(buf):
            assert main(["translate", "--checkpoint", str(run_dir / "averaged"), "-i",
                         str(src), "--beam", "1", "--quiet"]) == 0
        outputs.append(buf.getvalue())
    assert outputs[0] == outputs[1] != ""

    # aiayn evaluate translates raw input the same way, and scores the output as it is (tokenizing
    # it again would escape "&amp;" twice); cased references are not compared with it
    def first(path: Path, n: int = 40) -> list[str]:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read().splitlines()[:n]

    raw, tok = tmp_path / "raw.en", tmp_path / "ref.tok.de"
    refs = first(data_dir / "multi30k/tok/test_2016_flickr.lc.norm.tok.de.gz")
    raw.write_text("\n".join(first(data_dir / "multi30k/test_2016_flickr.en.gz")) + "\n",
                   encoding="utf-8")
    tok.write_text("\n".join(refs) + "\n", encoding="utf-8")
    translated, evaluated = tmp_path / "translate.de", tmp_path / "evaluate.de"
    assert main(["translate", "--checkpoint", str(run_dir / "averaged"), "-i", str(raw), "-o",
                 str(translated), "--beam", "1", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(run_dir / "averaged"), "--src", str(raw),
                 "--ref", str(data_dir / "multi30k/test_2016_flickr.de.gz"), "--ref-tok",
                 str(tok), "--output", str(evaluated), "--beam", "1", "--json", "--quiet"]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert evaluated.read_text(encoding="utf-8") == translated.read_text(encoding="utf-8")
    hyps = evaluated.read_text(encoding="utf-8").splitlines()
    assert scored["text"] == "lc-norm-tok" and set(scored["scores"]) == {"multi30k"}
    assert scored["scores"]["multi30k"]["bleu"] == pytest.approx(
        BLEU(tokenize="none", force=True).corpus_score(hyps, [refs]).score)
    assert main(["evaluate", "--hyp", str(evaluated), "--pretokenized", "--ref-tok", str(tok),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["scores"] == scored["scores"]
    assert main(["evaluate", "--hyp", str(evaluated), "--pretokenized", "--ref",
                 str(raw)]) == 2  # lowercased, tokenized output needs the tokenized references

    # aiayn attention shows the attention over the text the model reads
    assert main(["attention", "--checkpoint", str(run_dir / "averaged"), "--text",
                 "A MAN IS RUNNING.", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["source"] == "a man is running ."


def test_curves_name_the_runs_protocol_and_schedule(tmp_path: Path) -> None:
    from aiayn.viz.curves import panel_titles

    # no config: the defaults' (Multi30k, whose validation BLEU is the Multi30k protocol's)
    assert panel_titles(tmp_path) == ("validation BLEU (greedy, Multi30k protocol)",
                                      "learning rate (§5.3, eq. 3)")
    (tmp_path / "config.json").write_text(json.dumps({"data": {"dataset": "files"}}))
    assert panel_titles(tmp_path)[0] == "validation BLEU (greedy, sacreBLEU cased)"
    (tmp_path / "config.json").write_text(json.dumps(
        {"data": {"preprocess": "lc-norm-tok"}, "train": {"lr_schedule": "linear"}}))
    assert panel_titles(tmp_path) == ("validation BLEU (greedy, Multi30k protocol)",
                                      "learning rate (linear decay to zero at the budget)")
