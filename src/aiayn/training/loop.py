"""The training loop: §5 recipe, checkpoints that resume exactly, validation, several processes.

One :class:`Trainer` runs on one process; under ``torchrun`` each process holds one shard of
every epoch's batches and DistributedDataParallel averages the gradients. The loss of an update
is normalised by the target tokens of the whole global batch (all accumulation steps, all
processes), so N processes with one batch each make the same update as one process that
accumulates the same N batches.

Run directory::

    RUN/config.json        every value that shaped the run (``aiayn train --config RUN/config.json``)
    RUN/tokenizer.json     the shared vocabulary
    RUN/metrics.jsonl      one JSON object per log line (train and valid)
    RUN/tb/                TensorBoard event files
    RUN/checkpoints/step-N the last ``keep_last`` checkpoints (with training state)
    RUN/best/              the checkpoint with the best validation BLEU (or loss)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from aiayn.checkpoint import (
    list_checkpoints,
    load_training_state,
    prune_checkpoints,
    save_checkpoint,
)
from aiayn.config import Config
from aiayn.data.batching import EncodedCorpus, collate, make_batches
from aiayn.data.corpus import ParallelCorpus
from aiayn.data.vocab import PAD_ID, Vocabulary
from aiayn.errors import UserError
from aiayn.fileio import write_json_atomic
from aiayn.model import Transformer, count_parameters
from aiayn.training.loss import label_smoothed_loss
from aiayn.training.schedule import learning_rate


@dataclass
class DistInfo:
    """Where this process stands among ``world_size`` (1 when not under torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> DistInfo:
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))


def init_distributed(device: torch.device) -> DistInfo:
    """Join the process group torchrun describes (gloo on CPU, nccl on CUDA); the one place
    that does (:func:`aiayn.training.run.run_training` calls it before anything else). A no-op
    for a single process or when already joined."""
    info = DistInfo.from_env()
    if info.world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL and object collectives use the current device
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return info


@dataclass
class TrainState:
    """What a resumed run needs besides the weights (all plain values: weights_only-loadable)."""

    step: int = 0  # updates taken
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of this process's shard consumed in ``epoch``
    elapsed_s: float = 0.0  # training wall time so far, evaluation included
    nonfinite_total: int = 0
    best_metric: float | None = None  # best validation BLEU (or -loss when BLEU is off)
    evals_since_best: int = 0
    target_tokens: int = 0  # target tokens trained on, all processes
    extra: dict[str, Any] = field(default_factory=dict)


class StopTraining(UserError):
    """Raised inside the loop to end it early with a message (non-finite losses)."""


class Trainer:
    """Trains ``model`` on ``train`` (encoded pairs) as ``config.train`` says.

    Args:
        config: the whole run config (model, data, train, decode).
        run_dir: where checkpoints, metrics and events go (see module docstring).
        vocab: the shared vocabulary (saved into every checkpoint).
        train: encoded training pairs.
        valid: raw validation pairs (BLEU) and ``valid_encoded`` their encoding (loss).
        device: ``cpu`` or ``cuda:N``.
        progress: show a tqdm progress bar (main process only).
    """

    def __init__(
        self,
        config: Config,
        run_dir: str | Path,
        vocab: Vocabulary,
        train: EncodedCorpus,
        valid: ParallelCorpus | None = None,
        valid_encoded: EncodedCorpus | None = None,
        device: str | torch.device = "cpu",
        progress: bool = True,
        math_attention: bool | None = None,
    ) -> None:
        self.config = config
        self.tc = config.train
        self.run_dir = Path(run_dir)
        self.vocab = vocab
        self.train_data = train
        self.valid = valid
        self.valid_encoded = valid_encoded
        self.device = torch.device(device)
        self.dist = DistInfo.from_env()
        if self.dist.world_size > 1 and not dist.is_initialized():
            raise RuntimeError("several processes: call init_distributed(device) before "
                               "building a Trainer")
        if len(train) == 0:
            raise ValueError("no training pairs: every epoch would be empty")
        self.progress = progress and self.dist.is_main
        # SDPA's CPU flash kernel has a slow backward at sentence lengths of ~30 tokens; the
        # plain math kernel is faster there (measured in bench/bench_train.py).
        self.math_attention = self.device.type == "cpu" if math_attention is None \
            else math_attention
        self.state = TrainState()
        self._stop_signal: int | None = None
        self._last_ckpt_time = time.monotonic()
        self._src_len = train.src_lengths()
        self._tgt_len = train.tgt_lengths()
        self._epoch_batches: list[list[int]] | None = None

        torch.manual_seed(self.tc.seed)
        self.model = Transformer(config.model).to(self.device)
        if self.dist.world_size > 1:  # same initial weights, different dropout masks
            torch.manual_seed(self.tc.seed + 1000 * self.dist.rank)
        self.ddp_model: nn.Module = self.model
        if self.dist.world_size > 1:
            self.ddp_model = nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.optimizer = torch.optim.Adam(
            self.model.parameters(), lr=0.0, betas=(self.tc.adam_beta1, self.tc.adam_beta2),
            eps=self.tc.adam_eps, weight_decay=self.tc.weight_decay)
        self.writer = None
        self.metrics_path = self.run_dir / "metrics.jsonl"

    # --- data -----------------------------------------------------------------------------
    def _batches_of_epoch(self, epoch: int) -> list[list[int]]:
        return make_batches(self._src_len, self._tgt_len, self.config.data.max_tokens,
                            seed=self.tc.seed, epoch=epoch, shuffle=True,
                            num_shards=self.dist.world_size, shard_index=self.dist.rank)

    def _next_batch_indices(self) -> list[int]:
        s = self.state
        if self._epoch_batches is None:
            self._epoch_batches = self._batches_of_epoch(s.epoch)
        while s.batch_in_epoch >= len(self._epoch_batches):
            if not self._epoch_batches and s.batch_in_epoch == 0:
                raise ValueError(f"epoch {s.epoch} has no batch")  # guarded in __init__
            s.epoch += 1
            s.batch_in_epoch = 0
            self._epoch_batches = self._batches_of_epoch(s.epoch)
        indices = self._epoch_batches[s.batch_in_epoch]
        s.batch_in_epoch += 1
        return indices

    # --- checkpoints ----------------------------------------------------------------------
    def _training_state(self) -> dict[str, Any]:
        s = self.state
        return {
            "step": s.step, "epoch": s.epoch, "batch_in_epoch": s.batch_in_epoch,
            "elapsed_s": s.elapsed_s, "nonfinite_total": s.nonfinite_total,
            "best_metric": s.best_metric, "evals_since_best": s.evals_since_best,
            "target_tokens": s.target_tokens,
            "optimizer": self.optimizer.state_dict(),
            # dropout masks: every process's own generators; batching has its own seed
            "rng": self._gather_rng_states(),
            "rank": self.dist.rank, "world_size": self.dist.world_size,
        }

    def _rng_state(self) -> dict[str, torch.Tensor]:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _gather_rng_states(self) -> list[dict[str, torch.Tensor]]:
        """Each process's CPU (and CUDA) RNG state, by rank (a collective: all ranks call it)."""
        mine = self._rng_state()
        if self.dist.world_size == 1:
            return [mine]
        states: list[Any] = [None] * self.dist.world_size
        dist.all_gather_object(states, mine)
        return states

    def _weights_finite(self) -> bool:
        norm = nn.utils.get_total_norm([p.detach() for p in self.model.parameters()])
        return bool(torch.isfinite(norm))

    def save(self, reason: str = "periodic") -> Path | None:
        """Write ``checkpoints/step-N`` (main process) and prune to ``keep_last``. Weights that
        are not all finite are never written (returns None then, and on other processes).
        Every process must call it (the RNG states are gathered)."""
        self._last_ckpt_time = time.monotonic()
        if not self._weights_finite():  # the same on every process: DDP keeps weights equal
            return None
        state = self._training_state()
        if not self.dist.is_main:
            return None
        path = self.run_dir / "checkpoints" / f"step-{self.state.step:08d}"
        meta = {"step": self.state.step, "epoch": self.state.epoch, "reason": reason,
                "elapsed_s": round(self.state.elapsed_s, 1), "time": time.time()}
        save_checkpoint(path, self.model, self.config, self.vocab, meta, state)
        prune_checkpoints(self.run_dir, self.tc.keep_last)
        return path

    def resume(self, checkpoint: Path) -> None:
        """Restore weights, optimizer, schedule position, RNGs and data position."""
        from safetensors.torch import load_model

        load_model(self.model, str(checkpoint / "model.safetensors"), strict=False,
                   device=str(self.device))
        st = load_training_state(checkpoint)
        if st.get("world_size", 1) != self.dist.world_size:
            raise UserError(f"{checkpoint} was written by a run of {st.get('world_size')} "
                            f"processes; resume it with the same number (now "
                            f"{self.dist.world_size})")
        self.optimizer.load_state_dict(st["optimizer"])
        self.state = TrainState(
            step=st["step"], epoch=st["epoch"], batch_in_epoch=st["batch_in_epoch"],
            elapsed_s=st["elapsed_s"], nonfinite_total=st["nonfinite_total"],
            best_metric=st["best_metric"], evals_since_best=st["evals_since_best"],
            target_tokens=st["target_tokens"])
        if "rng" in st:
            mine = st["rng"][self.dist.rank]
            torch.set_rng_state(mine["cpu"])
            if "cuda" in mine and self.device.type == "cuda":
                torch.cuda.set_rng_state(mine["cuda"], self.device)
        else:  # checkpoints of earlier versions kept rank 0's CPU state only
            torch.set_rng_state(st["torch_rng"])
        self._epoch_batches = None

    # --- one update -----------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.tc.bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _attention_backend(self) -> contextlib.AbstractContextManager:
        if self.math_attention:
            return sdpa_kernel(SDPBackend.MATH)
        return contextlib.nullcontext()

    def _batch_loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Label-smoothed loss of one batch (§5.4), summed over its non-pad target tokens; only
        those positions reach the output layer. Returns (loss_sum, nll_sum, n_tokens)."""
        keep = batch.tgt_out != PAD_ID  # (B, T)
        with self._autocast():
            logits = model(batch.src, batch.tgt_in, output_mask=keep)  # (n, V)
        return label_smoothed_loss(logits, batch.tgt_out[keep], self.tc.epsilon_ls, PAD_ID)

    def train_step(self) -> dict[str, float]:
        """One update from ``accum_steps`` batches (per process). Returns loss figures."""
        self.ddp_model.train()
        batches = [collate(self.train_data, self._next_batch_indices()).to(self.device)
                   for _ in range(self.tc.accum_steps)]
        tokens = torch.tensor([float(sum(b.tgt_tokens for b in batches))], device=self.device)
        if self.dist.world_size > 1:
            dist.all_reduce(tokens)
        global_tokens = float(tokens.item())
        # DDP averages gradients over processes: scale by world_size to get a global sum.
        scale = self.dist.world_size / global_tokens
        loss_sum = nll_sum = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(batches):
            sync = i == len(batches) - 1
            ctx = self.ddp_model.no_sync() if (self.dist.world_size > 1 and not sync) \
                else contextlib.nullcontext()
            with ctx, self._attention_backend():
                loss, nll, _ = self._batch_loss(self.ddp_model, batch)
                (loss * scale).backward()
            loss_sum += float(loss.detach())
            nll_sum += float(nll)
        figures = torch.tensor([loss_sum, nll_sum], device=self.device)
        if self.dist.world_size > 1:
            dist.all_reduce(figures)
        loss_tok, nll_tok = (figures / global_tokens).tolist()
        # One fused norm over all gradients (already averaged across processes by DDP, so
        # every process sees the same value) both detects non-finite gradients and clips.
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        total_norm = nn.utils.get_total_norm(grads)
        grad_norm = float(total_norm)
        if not (math.isfinite(loss_tok) and math.isfinite(grad_norm)):
            return {"loss": loss_tok, "nll": nll_tok, "tokens": global_tokens, "skipped": 1.0}
        if self.tc.clip_norm > 0:
            nn.utils.clip_grads_with_norm_(grads, self.tc.clip_norm, total_norm)
        lr = learning_rate(self.state.step + 1, self.config.model.d_model,
                           self.tc.warmup_steps, self.tc.lr_scale)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.state.step += 1
        self.state.target_tokens += int(global_tokens)
        return {"loss": loss_tok, "nll": nll_tok, "tokens": global_tokens, "lr": lr,
                "grad_norm": grad_norm, "skipped": 0.0}

    # --- validation -----------------------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Validation loss and perplexity (per target subword) and greedy BLEU (sacreBLEU,
        cased, detokenized) on the first ``eval_bleu_sentences`` pairs. Main process only."""
        self.model.eval()
        out: dict[str, float] = {}
        if self.valid_encoded is not None and len(self.valid_encoded):
            loss_sum = nll_sum = n = 0.0
            order = make_batches(self.valid_encoded.src_lengths(),
                                 self.valid_encoded.tgt_lengths(),
                                 self.config.data.max_tokens, shuffle=False)
            for idx in order:
                b = collate(self.valid_encoded, idx).to(self.device)
                loss, nll, k = self._batch_loss(self.model, b)
                loss_sum, nll_sum, n = loss_sum + float(loss), nll_sum + float(nll), n + k
            out["valid_loss"] = loss_sum / n
            out["valid_nll"] = nll_sum / n
            out["valid_ppl"] = math.exp(min(nll_sum / n, 50.0))
        k = self.tc.eval_bleu_sentences
        if self.valid is not None and k > 0:
            from aiayn.decoding import translate_lines
            from aiayn.evaluation.bleu import sacrebleu_scores

            src, ref = self.valid.src[:k], self.valid.tgt[:k]
            hyps = translate_lines(self.model, self.vocab, src, beam_size=1,
                                   max_len_a=self.config.decode.max_len_a,
                                   max_len_b=self.config.decode.max_len_b,
                                   batch_size=self.config.decode.batch_size, bf16=self.tc.bf16)
            scores = sacrebleu_scores(hyps, ref)
            out["valid_bleu"] = scores["bleu"]
            out["valid_chrf"] = scores["chrf"]
        return out

    # --- logging --------------------------------------------------------------------------
    def _log(self, record: dict[str, Any]) -> None:
        if not self.dist.is_main:
            return
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key not in ("step", "kind") and isinstance(value, (int, float)):
                    self.writer.add_scalar(f"{record['kind']}/{key}", value, record["step"])
            self.writer.flush()

    # --- the loop -------------------------------------------------------------------------
    def _install_signal_handlers(self) -> dict[int, Any]:
        def handler(signum: int, frame: Any) -> None:
            self._stop_signal = signum

        old = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                old[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread
                pass
        return old

    def fit(self) -> dict[str, Any]:
        """Train until ``max_steps``, ``time_budget_s``, early stopping or a signal.

        SIGINT / SIGTERM finish the current update, write a checkpoint and return.

        Returns:
            A summary: steps, elapsed_s, why it stopped, best metric, last validation figures.

        Raises:
            StopTraining: more than ``max_nonfinite`` non-finite losses in a row (a checkpoint of
                the last good state is written first).
        """
        tc = self.tc
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.run_dir / "tb"))
        old_handlers = self._install_signal_handlers()
        bar = None
        if self.progress:
            from tqdm import tqdm

            # a time budget ends the run before max_steps: then the bar counts training seconds
            by_time = bool(tc.time_budget_s)
            bar = tqdm(total=int(tc.time_budget_s) if by_time else tc.max_steps,
                       initial=int(self.state.elapsed_s) if by_time else self.state.step,
                       unit="s" if by_time else "step", desc="train", dynamic_ncols=True,
                       file=sys.stderr, mininterval=1.0,
                       bar_format=("{l_bar}{bar}| {n_fmt}/{total_fmt} s of training "
                                   "[{elapsed}<{remaining}{postfix}]") if by_time else None)
        stop_reason = "max_steps"
        last_valid: dict[str, float] = {}
        consecutive_bad = 0
        window = {"tokens": 0.0, "loss": 0.0, "nll": 0.0, "steps": 0, "t0": time.monotonic()}
        t_prev = time.monotonic()
        try:
            while self.state.step < tc.max_steps:
                # the main process decides (clocks and signals differ by rank): one broadcast
                stop, budget, early, due = self._agree(
                    self._stop_signal is not None,
                    bool(tc.time_budget_s) and self.state.elapsed_s >= tc.time_budget_s,
                    bool(tc.early_stopping_patience)
                    and self.state.evals_since_best >= tc.early_stopping_patience,
                    bool(tc.checkpoint_every_s)
                    and time.monotonic() - self._last_ckpt_time >= tc.checkpoint_every_s)
                if stop:
                    name = signal.Signals(self._stop_signal).name if self._stop_signal \
                        else "on the main process"
                    stop_reason = f"signal {name}"
                    break
                if budget or early:
                    stop_reason = "time_budget" if budget else "early_stopping"
                    break
                if due:
                    self.save()
                    t_prev = time.monotonic()
                fig = self.train_step()
                now = time.monotonic()
                self.state.elapsed_s += now - t_prev
                t_prev = now
                if fig["skipped"]:
                    consecutive_bad += 1
                    self.state.nonfinite_total += 1
                    if consecutive_bad > tc.max_nonfinite:
                        path = self.save("nonfinite")
                        if path is not None:
                            where = f"the last good state is in {path}"
                        else:
                            found = list_checkpoints(self.run_dir)
                            where = ("the weights are not finite, so no checkpoint was written; "
                                     + (f"the newest saved one is {found[-1]}" if found
                                        else "none was saved before"))
                        raise StopTraining(
                            f"{consecutive_bad} non-finite losses in a row at step "
                            f"{self.state.step}; {where}. Lower the learning rate "
                            "(train.lr_scale) or enable train.clip_norm.")
                    continue
                consecutive_bad = 0
                window["tokens"] += fig["tokens"]
                window["loss"] += fig["loss"] * fig["tokens"]
                window["nll"] += fig["nll"] * fig["tokens"]
                window["steps"] += 1
                step = self.state.step
                if bar is not None:
                    done = min(int(self.state.elapsed_s), bar.total) if by_time else step
                    bar.update(done - bar.n)
                if step % tc.log_every_steps == 0 or step == 1:
                    dt = max(now - window["t0"], 1e-9)
                    record = {
                        "kind": "train", "step": step, "epoch": self.state.epoch,
                        "loss": window["loss"] / window["tokens"],
                        "nll": window["nll"] / window["tokens"],
                        "ppl": math.exp(min(window["nll"] / window["tokens"], 50.0)),
                        "lr": fig["lr"], "tokens_per_s": window["tokens"] / dt,
                        "elapsed_s": round(self.state.elapsed_s, 2),
                        "nonfinite_total": self.state.nonfinite_total,
                    }
                    self._log(record)
                    if bar is not None:
                        bar.set_postfix(step=step, loss=f"{record['loss']:.3f}",
                                        lr=f"{fig['lr']:.2e}",
                                        tok_s=f"{record['tokens_per_s']:.0f}")
                    window = {"tokens": 0.0, "loss": 0.0, "nll": 0.0, "steps": 0,
                              "t0": time.monotonic()}
                if step % tc.eval_every_steps == 0:
                    last_valid = self._evaluate_and_track()
                    t_prev = time.monotonic()
                if tc.checkpoint_every_steps and step % tc.checkpoint_every_steps == 0:
                    self.save()
                    t_prev = time.monotonic()
            if self.state.step % tc.eval_every_steps != 0 or not last_valid:
                last_valid = self._evaluate_and_track()
            self.save(stop_reason)
        finally:
            if bar is not None:
                bar.close()
            for sig, h in old_handlers.items():
                signal.signal(sig, h)
            if self.writer is not None:
                self.writer.close()
        summary = {
            "steps": self.state.step, "epochs": self.state.epoch,
            "elapsed_s": round(self.state.elapsed_s, 1), "stop_reason": stop_reason,
            "target_tokens": self.state.target_tokens,
            "nonfinite_total": self.state.nonfinite_total,
            "parameters": count_parameters(self.model), **last_valid,
        }
        if self.dist.is_main:
            write_json_atomic(self.run_dir / "train_summary.json", summary)
        return summary

    def _agree(self, *decisions: bool) -> tuple[bool, ...]:
        """The main process's decisions, shared with all in one broadcast on the training
        device (NCCL reduces and broadcasts only tensors on the GPU)."""
        if self.dist.world_size == 1:
            return tuple(bool(d) for d in decisions)
        flags = torch.tensor([1 if d else 0 for d in decisions], dtype=torch.uint8,
                             device=self.device)
        dist.broadcast(flags, src=0)
        return tuple(bool(f) for f in flags.tolist())

    def _evaluate_and_track(self) -> dict[str, float]:
        figures: dict[str, float] = {}
        if self.dist.is_main:
            t0 = time.monotonic()
            figures = self.validate()
            figures["valid_seconds"] = time.monotonic() - t0
            metric = figures.get("valid_bleu", -figures.get("valid_loss", float("inf")))
            s = self.state
            better = math.isfinite(metric) and (s.best_metric is None or metric > s.best_metric)
            if better and self._weights_finite():
                s.best_metric = metric
                s.evals_since_best = 0
                meta = {"step": s.step, **{k: round(v, 4) for k, v in figures.items()}}
                save_checkpoint(self.run_dir / "best", self.model, self.config, self.vocab, meta)
            else:
                s.evals_since_best += 1
            self._log({"kind": "valid", "step": s.step, "elapsed_s": round(s.elapsed_s, 2),
                       **figures})
        # evals_since_best lives on the main process; the next step's flags carry its verdict
        return figures
