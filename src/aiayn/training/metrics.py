"""What a run reports while it trains: ``RUN/metrics.jsonl`` and TensorBoard
(:class:`MetricsSink`), the token-weighted figures of a log line (:class:`Window`) and the
progress bar (:class:`Progress`)."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from aiayn.devices import cpu_times, steal_percent
from aiayn.rundir import RunDir


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
