"""The small pieces the training loop is made of, each usable and testable alone: the metrics
sink, the progress bar, the checkpointer and validation."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from aiayn.checkpoint import list_checkpoints, prune_checkpoints, save_checkpoint
from aiayn.config import Config
from aiayn.data.batching import EncodedCorpus, collate, make_batches
from aiayn.data.corpus import ParallelCorpus
from aiayn.data.vocab import Vocabulary
from aiayn.devices import cpu_times, steal_percent
from aiayn.rundir import RunDir

if TYPE_CHECKING:
    from aiayn.training.step import BatchLoss


class MetricsSink:
    """``RUN/metrics.jsonl`` (one JSON object per record) and TensorBoard events in ``RUN/tb``.
    Disabled (every call a no-op) on processes other than the main one."""

    def __init__(self, run_dir: str | Path, enabled: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.path = RunDir(self.run_dir).metrics
        self.enabled = enabled
        self.writer = None

    def open(self) -> None:
        if not self.enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(RunDir(self.run_dir).tensorboard))

    def log(self, record: dict[str, Any]) -> None:
        """Append ``record`` (with ``kind`` and ``step``) and add its numbers as scalars."""
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key not in ("step", "kind") and isinstance(value, (int, float)):
                    self.writer.add_scalar(f"{record['kind']}/{key}", value, record["step"])
            self.writer.flush()

    def rewind(self, step: int) -> int:
        """Drop the records of steps after ``step`` from ``metrics.jsonl``, atomically: a run
        resumed from the checkpoint of ``step`` trains those steps again, and its log must
        describe the weights it has, not an attempt that a kill undid. A last line cut off by
        a kill (not valid JSON) goes too. Returns how many lines were dropped. TensorBoard's
        events are left as they are (TensorBoard shows a rerun step as it sees fit)."""
        if not self.enabled or not self.path.is_file():
            return 0
        from aiayn.fileio import write_atomic

        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = []
        for i, line in enumerate(lines):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if i == len(lines) - 1 and not line.endswith("\n"):
                    continue  # torn by a kill mid-write
                kept.append(line)  # not ours to judge: keep it
                continue
            if not (isinstance(record, dict) and isinstance(record.get("step"), int)
                    and record["step"] > step):
                kept.append(line)
        if len(kept) < len(lines):
            write_atomic(self.path, "".join(kept))
        return len(lines) - len(kept)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class Progress:
    """A tqdm bar over updates, or over training seconds when a time budget ends the run."""

    def __init__(self, enabled: bool, max_steps: int, time_budget_s: float, step: int,
                 elapsed_s: float) -> None:
        self.bar = None
        self.by_time = bool(time_budget_s)
        if not enabled:
            return
        from tqdm import tqdm

        self.bar = tqdm(total=int(time_budget_s) if self.by_time else max_steps,
                        initial=int(elapsed_s) if self.by_time else step,
                        unit="s" if self.by_time else "step", desc="train", dynamic_ncols=True,
                        file=sys.stderr, mininterval=1.0,
                        bar_format=("{l_bar}{bar}| {n_fmt}/{total_fmt} s of training "
                                    "[{elapsed}<{remaining}{postfix}]") if self.by_time else None)

    def update(self, step: int, elapsed_s: float, /, **postfix: Any) -> None:
        if self.bar is None:
            return
        done = min(int(elapsed_s), self.bar.total) if self.by_time else step
        self.bar.update(done - self.bar.n)
        if postfix:
            self.bar.set_postfix(**postfix)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Window:
    """Token-weighted training figures since the last log line."""

    def __init__(self) -> None:
        self.tokens = self.loss = self.nll = 0.0
        self.t0 = time.monotonic()
        self.cpu0 = cpu_times()

    def add(self, fig: dict[str, float]) -> None:
        self.tokens += fig["tokens"]
        self.loss += fig["loss"] * fig["tokens"]
        self.nll += fig["nll"] * fig["tokens"]

    def record(self, step: int, epoch: int, lr: float, elapsed_s: float,
               nonfinite_total: int) -> dict[str, Any]:
        dt = max(time.monotonic() - self.t0, 1e-9)
        record = {"kind": "train", "step": step, "epoch": epoch,
                  "loss": self.loss / self.tokens, "nll": self.nll / self.tokens,
                  "ppl": math.exp(min(self.nll / self.tokens, 50.0)), "lr": lr,
                  "tokens_per_s": self.tokens / dt, "elapsed_s": round(elapsed_s, 2),
                  "nonfinite_total": nonfinite_total}
        steal = steal_percent(self.cpu0, cpu_times())
        if steal is not None:  # the machine's share of the slowdown, where Linux reports it
            record["cpu_steal_pct"] = round(steal, 1)
        return record


def weights_finite(model: nn.Module) -> bool:
    """Whether every parameter is finite (one fused norm)."""
    norm = nn.utils.get_total_norm([p.detach() for p in model.parameters()])
    return bool(torch.isfinite(norm))


class Checkpointer:
    """Writes ``RUN/checkpoints/step-N`` (with training state), ``RUN/best`` and ``RUN/ema``
    atomically (:func:`aiayn.checkpoint.save_checkpoint`) and keeps the last ``keep_last``
    steps.

    It writes what it is given: the Trainer checks :func:`weights_finite` first, because with
    several processes that decision must come before the RNG states are gathered, and a
    non-finite model must not become ``best/`` either."""

    def __init__(self, run_dir: str | Path, config: Config, vocab: Vocabulary,
                 keep_last: int) -> None:
        self.run_dir = Path(run_dir)
        self.config = config
        self.vocab = vocab
        self.keep_last = keep_last

    def save_step(self, model: nn.Module, meta: dict[str, Any],
                  training_state: dict[str, Any]) -> Path:
        """Write ``checkpoints/step-{meta['step']:08d}`` with ``training_state`` (optimizer, step
        and data position, every process's RNG) and prune older steps; returns its path.

        Raises:
            OSError: the write failed (full disk, permissions); earlier checkpoints stay.
        """
        path = RunDir(self.run_dir).step(meta["step"])
        save_checkpoint(path, model, self.config, self.vocab, meta, training_state)
        prune_checkpoints(self.run_dir, self.keep_last)
        return path

    def save_named(self, name: str, model: nn.Module, meta: dict[str, Any]) -> Path:
        """Replace ``RUN/<name>``, weights only (no training state): ``best`` (the best
        validation BLEU so far) or ``ema`` (the moving average of the weights); returns its
        path.

        Raises:
            OSError: the write failed (full disk, permissions); the earlier one stays.
        """
        return save_checkpoint(self.run_dir / name, model, self.config, self.vocab, meta)

    def newest(self) -> Path | None:
        """The newest complete ``checkpoints/step-N``, or None when there is none."""
        found = list_checkpoints(self.run_dir)
        return found[-1] if found else None




@torch.no_grad()
def validation_figures(model: nn.Module, batch_loss: BatchLoss, config: Config,
                       vocab: Vocabulary, valid: ParallelCorpus | None,
                       valid_encoded: EncodedCorpus | None,
                       device: torch.device, *, bf16: bool = False) -> dict[str, float]:
    """Validation loss and perplexity (per target subword) and greedy BLEU (the run's protocol,
    :func:`aiayn.evaluation.bleu.bleu_protocol`) on the first ``train.eval_bleu_sentences``
    pairs, decoded under bf16
    autocast when ``bf16`` (the run's resolved precision). Leaves ``model`` in eval mode."""
    model.eval()
    out: dict[str, float] = {}
    if valid_encoded is not None and len(valid_encoded):
        loss_sum = nll_sum = n = 0.0
        order = make_batches(valid_encoded.src_lengths(), valid_encoded.tgt_lengths(),
                             config.data.max_tokens, shuffle=False)
        for idx in order:
            batch = collate(valid_encoded, idx, start_id=config.model.decoder_start_id)
            loss, nll, k = batch_loss(model, batch.to(device))
            loss_sum, nll_sum, n = loss_sum + float(loss), nll_sum + float(nll), n + k
        out["valid_loss"] = loss_sum / n
        out["valid_nll"] = nll_sum / n
        out["valid_ppl"] = math.exp(min(nll_sum / n, 50.0))
    k = config.train.eval_bleu_sentences
    if valid is not None and k > 0:
        from aiayn.evaluation.bleu import chrf_score, corpus_bleu
        from aiayn.translator import Translator

        translator = Translator(model, vocab, config=config,
                                precision="bf16" if bf16 else "fp32")
        # greedy; the corpus is the model's text already (data.preprocess applied on loading)
        hyps = translator.translate(valid.src[:k], beam_size=1, preprocessed=True)
        refs = valid.tgt[:k]
        out["valid_bleu"] = corpus_bleu(hyps, refs, config.data)["bleu"]
        out["valid_chrf"] = chrf_score(hyps, refs)[0]
    return out
