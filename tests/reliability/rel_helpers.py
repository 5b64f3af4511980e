"""Shared pieces of the reliability tests: a tiny task, a tiny trained run, the CLI run
in-process with its output captured, and hashes of every file under a folder."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import random
import shutil
import signal
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path


from aiayn.config import Config, DataConfig, DecodeConfig, ModelConfig, TrainConfig

LETTERS = "abcdefghijklmnop"


def write_task(folder: Path, n: int, seed: int, prefix: str) -> tuple[Path, Path]:
    """``n`` pairs of 3-8 letter 'words'; the target copies the source."""
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 8))) for _ in range(n)]
    s, t = folder / f"{prefix}.src", folder / f"{prefix}.tgt"
    s.write_text("\n".join(lines) + "\n", encoding="utf-8")
    t.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return s, t


def small_config(folder: Path, n_train: int = 300, **train: object) -> Config:
    """A one-layer model on ``n_train`` copy pairs: a few steps take well under a second."""
    folder.mkdir(parents=True, exist_ok=True)
    train_src, train_tgt = write_task(folder, n_train, 1, "train")
    valid_src, valid_tgt = write_task(folder, 20, 2, "valid")
    data = DataConfig(dataset="files", train_src=str(train_src), train_tgt=str(train_tgt),
                      valid_src=str(valid_src), valid_tgt=str(valid_tgt), vocab_size=40,
                      max_tokens=256, max_len=32)
    model = ModelConfig(N=1, d_model=32, d_ff=64, h=4, d_k=8, d_v=8, P_drop=0.1,
                        vocab_size=40, max_len=64)
    defaults = dict(warmup_steps=20, lr_scale=2.0, max_steps=6, checkpoint_every_s=0,
                    checkpoint_every_steps=2, keep_last=3, eval_every_steps=3,
                    eval_bleu_sentences=4, log_every_steps=1,
                    precision="fp32")  # the same path on every CPU
    defaults.update(train)
    return Config(name="small", model=model, data=data, train=TrainConfig(**defaults),
                  decode=DecodeConfig(beam_size=2, max_len_b=8, batch_size=8))


def quiet(msg: str) -> None:
    pass


def copy_run(run_dir: Path, dest: Path) -> Path:
    shutil.copytree(run_dir, dest)
    return dest


@dataclass
class CliResult:
    code: int | None  # None: an exception escaped main (a traceback for the user)
    out: str
    err: str
    exception: str = ""

    @property
    def first_line(self) -> str:
        lines = [line for line in self.err.splitlines() if line.strip()]
        return lines[0] if lines else ""


def cli(argv: list[str], stdin: bytes = b"") -> CliResult:
    """``aiayn ARGV`` in this process, stdout and stderr captured (no traceback printing)."""
    from aiayn.cli import main

    out, err = io.StringIO(), io.StringIO()
    old_stdin = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    env_debug = os.environ.pop("AIAYN_DEBUG", None)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit_:  # argparse's own errors
                code = exit_.code if isinstance(exit_.code, int) else 1
            except BaseException:  # noqa: BLE001 - what a user would see as a traceback
                return CliResult(None, out.getvalue(), err.getvalue(), traceback.format_exc())
    finally:
        sys.stdin = old_stdin
        if env_debug is not None:
            os.environ["AIAYN_DEBUG"] = env_debug
    return CliResult(code, out.getvalue(), err.getvalue())


def tree_hashes(*roots: Path) -> dict[str, str]:
    """sha256 of every file (and the name of every folder) under ``roots``."""
    found: dict[str, str] = {}
    for root in roots:
        root = Path(root)
        if root.is_file():
            found[str(root)] = hashlib.sha256(root.read_bytes()).hexdigest()
            continue
        if not root.exists():
            found[str(root)] = "<absent>"
            continue
        for path in sorted(root.rglob("*")):
            if path.is_file():
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
            elif path.is_dir():
                found[str(path)] = "<dir>"
    return found


@contextlib.contextmanager
def within(seconds: int):
    """Fail with TimeoutError (instead of hanging the suite) when the body runs too long."""
    def on_alarm(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
