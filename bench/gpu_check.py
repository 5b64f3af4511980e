"""The GPU check: aiayn's CUDA paths end to end, one line per check.

The first eight checks take under 8 minutes on one GPU; ``fp16`` and ``throughput`` (added
after, not yet run on a GPU) train three more runs, the last of 2,000 ``base`` updates.

Run it where a GPU is (see ``bench/gpu_check.sh``, which calls this file):

    bash bench/gpu_check.sh                       # on CUDA, the full budgets
    bash bench/gpu_check.sh --device cpu --quick  # the same checks on a CPU, small (the tests)

Checks, in order:

- ``train``: ``aiayn train`` of the ``multi30k`` preset in bf16 on CUDA (``train.precision``
  auto on a CPU) for 150 updates, then ``--resume`` to 300; target tokens/s, the precision chosen,
  and that the resumed run ends at the asked step.
- ``collective``: ``torchrun`` with one process per GPU (two on a CPU): the process group
  (NCCL on CUDA, gloo on a CPU) and an all-reduce, with its bus bandwidth. With one GPU it
  is "not exercised": NCCL across devices needs two.
- ``torchrun``: ``aiayn train`` under ``torchrun``, those processes, DistributedDataParallel
  (on one GPU, "not exercised", as above).
- ``ddp_gloo``: ``aiayn train`` under ``torchrun`` with two processes on one device through
  gloo (``train.dist_backend=gloo``; ``cuda:0`` on a GPU): DistributedDataParallel built and
  stepping, with any number of GPUs.
- ``wmt_step``: ``bench/bench_wmt_step.py``: one WMT-shaped step (``base``, V = 37,000, 25k and
  3,125 target tokens, bf16) against ``torch.nn.Transformer`` with ``F.cross_entropy``, the
  loss's share of the step, peak memory, and the loss at other chunk sizes.
- ``bench_train``: ``bench/bench_train.py``: aiayn against ``torch.nn.Transformer``, MFU.
- ``bench_decode``: ``bench/bench_decode_peers.py``: beam-4 sentences/s against CTranslate2.
- ``main_job``: ``scripts/main_job.sh`` with a 5-minute budget: Multi30k test BLEU.
- ``fp16``: what ``train.precision=auto`` picks on this device (by its compute capability:
  bf16 from 8.0, fp16 with a loss scale below, TF32 for fp32 products from 8.0), then
  ``aiayn train`` of ``multi30k`` in fp16 with ``torch.amp.GradScaler`` and in fp32 for the
  same 200 updates: fp16's final loss within 10% of fp32's, its loss scale and skipped
  updates, both rates.
- ``throughput``: the real shape end to end: a WMT-shaped corpus (``make_synthetic_wmt.py``,
  200,000 pairs) with a 37,000-token BPE, ``aiayn prepare``d, then ``aiayn train --preset
  base`` (25,000 tokens an update, ``train.precision`` auto) for 2,000 updates from the
  prepared folder, under ``torchrun`` with NCCL over every GPU when there are two or more:
  target tokens/s and ms an update. Without newstest2013 in ``$AIAYN_DATA_DIR`` (the
  corpus's lengths) it is "not exercised".

Each prints ``check NAME: ok  FIGURES``, ``check NAME: not exercised (WHY)`` (what this machine
cannot show, never counted as passed) or ``check NAME: FAILED (...)``, with every command's
output in ``--out DIR/NAME.log``; ``--json`` prints one JSON object at the end. Exit status 1
when a check failed, 2 for bad arguments or a missing GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ("train", "collective", "torchrun", "ddp_gloo", "wmt_step", "bench_train",
          "bench_decode", "main_job", "fp16", "throughput")
THROUGHPUT_UPDATES = 2000  # the throughput check's updates on a GPU (--throughput-updates)


class NotExercised(Exception):
    """A check this machine cannot run (NCCL across devices on one GPU): said, not passed."""


@dataclass
class Plan:
    """What one run of the check does: its device, budgets and commands' arguments."""

    device: str  # "cuda" or "cpu"
    quick: bool
    python: str
    out: Path
    nproc: int  # processes under torchrun
    env: dict[str, str] = field(default_factory=dict)
    throughput_updates: int = THROUGHPUT_UPDATES

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    @property
    def precision(self) -> str:
        """bf16 on CUDA, as the check is meant to cover; on a CPU the machine's own choice."""
        return "bf16" if self.device == "cuda" else "auto"

    def train_args(self, run_dir: Path, steps: int) -> list[str]:
        preset = ["--preset", "tiny", "--set", "data.train_limit=2000"] if self.quick \
            else ["--preset", "multi30k"]
        return ["train", *preset, "--run-dir", str(run_dir), "--device", self.device,
                "--no-progress", "--json", "--set", f"train.precision={self.precision}",
                "--set", f"train.max_steps={steps}", "--set", "train.time_budget_s=0",
                "--set", f"train.checkpoint_every_steps={max(1, steps // 2)}",
                "--set", "train.checkpoint_every_s=0", "--set", "train.eval_bleu_sentences=0",
                "--set", f"train.eval_every_steps={steps}"]

    @property
    def train_device(self) -> str:
        """The device of one training process: ``cuda:0`` on a GPU, so that processes that
        share it under gloo all train there."""
        return "cuda:0" if self.device == "cuda" else "cpu"

    def aiayn(self, *args: str) -> list[str]:
        return [self.python, "-m", "aiayn", *args]

    def torchrun(self, *args: str, nproc: int | None = None) -> list[str]:
        return [self.python, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nproc or self.nproc}", *args]

    def across_devices(self) -> None:
        """Raises NotExercised where NCCL across devices cannot run: one GPU."""
        if self.device == "cuda" and self.nproc < 2:
            raise NotExercised("one GPU: NCCL across devices needs two; ddp_gloo runs "
                               "DistributedDataParallel on it instead")


def make_plan(device: str, quick: bool, python: str, out: Path, gpus: int) -> Plan:
    """The plan for ``device``; ``gpus``: CUDA devices seen (one torchrun process each)."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"--device {device!r}: expected cuda or cpu")
    if device == "cuda" and gpus < 1:
        raise ValueError("--device cuda: no CUDA GPU is visible here (torch.cuda.device_count() "
                         "is 0); run it on the GPU machine, or --device cpu --quick")
    nproc = gpus if device == "cuda" else 2
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                       os.environ.get("PYTHONPATH")]))}
    return Plan(device, quick, python, out, nproc, env)


def last_json(text: str) -> dict[str, Any]:
    """The last line of ``text`` that is a JSON object (commands print logs before it).

    Raises:
        ValueError: there is none.
    """
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise ValueError("no JSON line in the output")


def tokens_per_s(summary: dict[str, Any]) -> float:
    return summary["target_tokens"] / max(summary["elapsed_s"], 1e-9)


# --- the checks: each runs its commands and returns its figures ---------------------------------

Runner = Callable[[list[str], float], str]


def check_train(plan: Plan, run: Runner) -> dict[str, Any]:
    steps = 20 if plan.quick else 300
    run_dir = plan.out / "train-run"
    first = last_json(run(plan.aiayn(*plan.train_args(run_dir, steps // 2)), 300))
    resumed = last_json(run(plan.aiayn(*plan.train_args(run_dir, steps), "--resume"), 300))
    if resumed["steps"] != steps:
        raise RuntimeError(f"the resumed run ended at step {resumed['steps']}, not {steps}")
    return {"precision": first["precision"]["chosen"], "steps": resumed["steps"],
            "tokens_per_s": round(tokens_per_s(first)), "valid_nll": resumed.get("valid_nll")}


def check_collective(plan: Plan, run: Runner) -> dict[str, Any]:
    plan.across_devices()
    got = last_json(run(plan.torchrun(str(Path(__file__).resolve()), "--collective",
                                      "--device", plan.device), 120))
    if got["sum"] != got["expected"]:
        raise RuntimeError(f"all_reduce gave {got['sum']}, expected {got['expected']}")
    return got


def check_torchrun(plan: Plan, run: Runner) -> dict[str, Any]:
    plan.across_devices()
    steps = 4 if plan.quick else 100
    summary = last_json(run(plan.torchrun("-m", "aiayn", *plan.train_args(
        plan.out / "torchrun-run", steps)), 300))
    if summary["steps"] != steps:
        raise RuntimeError(f"torchrun's run ended at step {summary['steps']}, not {steps}")
    return {"processes": plan.nproc, "backend": plan.backend, "steps": summary["steps"],
            "tokens_per_s": round(tokens_per_s(summary))}


def check_ddp_gloo(plan: Plan, run: Runner) -> dict[str, Any]:
    steps = 4 if plan.quick else 50
    args = plan.train_args(plan.out / "ddp_gloo-run", steps)
    args[args.index("--device") + 1] = plan.train_device
    summary = last_json(run(plan.torchrun("-m", "aiayn", *args, "--set",
                                          "train.dist_backend=gloo", nproc=2), 300))
    if summary["steps"] != steps:
        raise RuntimeError(f"the gloo run ended at step {summary['steps']}, not {steps}")
    return {"processes": 2, "backend": "gloo", "device": plan.train_device,
            "steps": summary["steps"], "tokens_per_s": round(tokens_per_s(summary))}


def check_wmt_step(plan: Plan, run: Runner) -> dict[str, Any]:
    extra = ["--quick"] if plan.quick else \
        ["--chunk-elements", str(2**20), str(2**22), str(2**24), str(2**26)]
    got = last_json(run([plan.python, str(ROOT / "bench" / "bench_wmt_step.py"), "--device",
                         plan.device, "--json", *extra], 300))
    return {str(r["tokens"]): {"speedup": r["speedup"],
                               "aiayn_ms": r["aiayn"]["step_ms"],
                               "torch_ms": r["torch"]["step_ms"],
                               "aiayn_loss_share": r["aiayn"]["loss_share"],
                               "torch_loss_share": r["torch"]["loss_share"],
                               "aiayn_peak_gib": r["aiayn"]["peak_gib"],
                               "torch_peak_gib": r["torch"]["peak_gib"],
                               "loss_ms_by_chunk": r["aiayn"]["loss_ms_by_chunk_elements"]}
            for r in got["rows"]}


def check_bench_train(plan: Plan, run: Runner) -> dict[str, Any]:
    extra = ["--presets", "tiny", "--steps", "2", "--warmup", "0"] if plan.quick \
        else ["--presets", "multi30k", "base", "--steps", "10"]
    got = last_json(run([plan.python, str(ROOT / "bench" / "bench_train.py"), "--device",
                         plan.device, "--json", *extra], 300))
    # bf16 figures where the device has bf16 (CUDA, a bf16-class CPU), else fp32's
    kind = "bf16" if got["native_bf16"] else "fp32"
    return {r["preset"]: {f"ratio_{kind}": round(r[f"ratio_{kind}"], 2),
                          f"mfu_{kind}": round(r[f"mfu_{kind}"], 3)} for r in got["rows"]}


def check_bench_decode(plan: Plan, run: Runner) -> dict[str, Any]:
    out = plan.out / "bench_decode.json"
    extra = (["--models", "multi30k", "--searches", "greedy", "--sentences", "16", "--length",
              "4", "--skip", "hf-fp32", "hf-bf16"] if plan.quick
             # two rounds, the faster kept: a GPU's first call of each batch shape is many
             # times slower (the first bf16 row ran at 34 sentences/s, the next at 165)
             else ["--models", "base", "--searches", "beam4", "--sentences", "256",
                   "--repeat", "2"])
    run([plan.python, str(ROOT / "bench" / "bench_decode_peers.py"), "--device", plan.device,
         "--json-out", str(out), "--work-dir", str(plan.out / "bench_decode-work"), *extra], 420)
    rows = json.loads(out.read_text(encoding="utf-8"))["results"]
    return {r["system"]: {"sent_per_s": round(r["sent_per_s"], 1),
                          "x_ct2_int8": round(r.get("x_ct2_int8_best", float("nan")), 2)}
            for r in rows}


def check_main_job(plan: Plan, run: Runner) -> dict[str, Any]:
    extra = (["--time-budget-min", "0.2", "--preset", "tiny", "--ensemble", "1", "--alphas",
              "0.6", "--average", "1", "--set", "data.train_limit=2000", "--set",
              "decode.max_len_b=5"] if plan.quick else ["--time-budget-min", "5"])
    got = last_json(run(["bash", str(ROOT / "scripts" / "main_job.sh"), "--device",
                         plan.device, "--run-dir", str(plan.out / "main_job-run"), "--json",
                         "--no-progress", *extra], 600))
    return {"multi30k_tok_bleu": got.get("multi30k_tok_bleu"), "train_steps": got["train_steps"],
            "precision": got["precision"]["chosen"], "decode_wall_s": got["decode_wall_s"]}


def final_train_record(run_dir: Path) -> dict[str, Any]:
    """The last ``train`` record of a run's ``metrics.jsonl``.

    Raises:
        ValueError: there is none.
    """
    records = [json.loads(line) for line in
               (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
               if line.strip()]
    train = [r for r in records if r.get("kind") == "train"]
    if not train:
        raise ValueError(f"{run_dir}/metrics.jsonl has no train record")
    return train[-1]


def check_fp16(plan: Plan, run: Runner) -> dict[str, Any]:
    steps = 10 if plan.quick else 200
    preset = "tiny" if plan.quick else "multi30k"
    auto = last_json(run([plan.python, "-c", (
        "import json; from aiayn.config import load_config; "
        "from aiayn.precision import choose_precision; "
        f"print(json.dumps(choose_precision('auto', '{plan.train_device}', "
        f"load_config('{preset}').model).to_dict()))")], 120))
    got: dict[str, Any] = {"auto": auto["chosen"], "capability": auto.get("capability"),
                           "auto_tf32": auto.get("tf32")}
    for precision in ("fp16", "fp32"):
        run_dir = plan.out / f"fp16-{precision}-run"
        args = plan.train_args(run_dir, steps)
        args[args.index(f"train.precision={plan.precision}")] = f"train.precision={precision}"
        summary = last_json(run(plan.aiayn(*args, "--set", "train.log_every_steps=10"), 300))
        if summary["steps"] != steps or summary["precision"]["chosen"] != precision:
            raise RuntimeError(f"the {precision} run ended at step {summary['steps']} in "
                               f"{summary['precision']['chosen']}")
        record = final_train_record(run_dir)
        got[f"{precision}_loss"] = round(record["loss"], 4)
        got[f"{precision}_tokens_per_s"] = round(tokens_per_s(summary))
        if precision == "fp16":
            if not summary["precision"].get("loss_scaling"):
                raise RuntimeError("the fp16 run did not scale its loss")
            got["loss_scale"] = record.get("loss_scale")
            got["fp16_skipped"] = summary["nonfinite_total"]
        else:
            got["fp32_tf32"] = summary["precision"].get("tf32")
    if not got["fp16_loss"] <= 1.1 * got["fp32_loss"]:  # NaN fails too
        raise RuntimeError(f"fp16's loss {got['fp16_loss']} after {steps} updates is not "
                           f"within 10% of fp32's {got['fp32_loss']}")
    return got


def check_throughput(plan: Plan, run: Runner) -> dict[str, Any]:
    data_dir = os.environ.get("AIAYN_DATA_DIR", "")
    if not (Path(data_dir) / "wmt14-en-de" / "newstest2013.en").is_file():
        raise NotExercised("no $AIAYN_DATA_DIR/wmt14-en-de/newstest2013.en: the synthetic "
                           "corpus takes its sentence lengths from it")
    pairs, vocab_size, updates = (3000, 500, 20) if plan.quick else \
        (200_000, 37_000, plan.throughput_updates)
    work = plan.out / "throughput"
    raw, vocab, prepared = work / "raw", work / "vocab", work / "prepared"
    run([plan.python, str(ROOT / "bench" / "make_synthetic_wmt.py"), "--pairs", str(pairs),
         "-o", str(raw)], 300)
    src, tgt = str(raw / "train.en"), str(raw / "train.de")
    run(plan.aiayn("vocab", "--src", src, "--tgt", tgt, "--size", str(vocab_size),
                   "--sample-lines", str(min(2 * pairs, 200_000)), "-o", str(vocab)), 600)
    run(plan.aiayn("prepare", "--src", src, "--tgt", tgt, "--vocab", str(vocab),
                   "-o", str(prepared)), 600)
    preset = ["--preset", "tiny", "--set", "data.global_max_tokens=2048",
              "--set", "data.max_tokens=0"] if plan.quick else ["--preset", "base"]
    args = ["train", *preset, "--vocab", str(vocab), "--run-dir", str(work / "run"),
            "--device", plan.device, "--no-progress", "--json",
            "--set", "data.dataset=files", "--set", f"data.prepared={prepared}",
            "--set", f"train.max_steps={updates}", "--set", "train.time_budget_s=0",
            "--set", "train.checkpoint_every_steps=0", "--set", "train.checkpoint_every_s=0",
            "--set", f"train.eval_every_steps={updates}", "--set", "train.eval_bleu_sentences=0",
            "--set", "train.log_every_steps=100"]
    processes = plan.nproc if plan.device == "cuda" else 1
    cmd = plan.torchrun("-m", "aiayn", *args) if processes > 1 else plan.aiayn(*args)
    summary = last_json(run(cmd, 600))
    if summary["steps"] != updates:
        raise RuntimeError(f"the run ended at update {summary['steps']}, not {updates}")
    return {"pairs": pairs, "vocab": vocab_size, "updates": updates, "processes": processes,
            "backend": plan.backend if processes > 1 else None,
            "precision": summary["precision"]["chosen"],
            "tokens_per_s": round(tokens_per_s(summary)),
            "ms_per_update": round(1000 * summary["elapsed_s"] / max(summary["steps"], 1), 1)}


CHECK_FUNCTIONS = {"train": check_train, "collective": check_collective,
                   "torchrun": check_torchrun, "ddp_gloo": check_ddp_gloo,
                   "wmt_step": check_wmt_step, "bench_train": check_bench_train,
                   "bench_decode": check_bench_decode, "main_job": check_main_job,
                   "fp16": check_fp16, "throughput": check_throughput}


def collective_worker(device: str) -> int:
    """Under torchrun: join the group (NCCL on CUDA, gloo on a CPU), all-reduce, print JSON."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if device == "cuda" \
        else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    x = torch.full((1,), float(rank + 1), device=dev)
    dist.all_reduce(x)
    big = torch.ones(64 * 2**20 // 4, device=dev)  # 64 MiB: a bandwidth, not a latency
    dist.all_reduce(big)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(big)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = (time.perf_counter() - t0) / 5
    # the ring all-reduce's bus bandwidth, as nccl-tests reports it
    bus = big.numel() * 4 * 2 * (world - 1) / max(world, 1) / seconds / 1e9
    if rank == 0:
        print(json.dumps({"backend": dist.get_backend(), "world_size": world,
                          "sum": float(x.item()), "expected": world * (world + 1) / 2,
                          "bus_gb_s": round(bus, 2)}), flush=True)
    dist.destroy_process_group()
    return 0


def run_checks(plan: Plan, names: list[str], say: Callable[[str], None]) -> dict[str, Any]:
    """Run the checks ``names`` in order; returns {name: {"ok", "seconds", figures or error}};
    a check this machine cannot run has ``"ok": None`` and ``"not_exercised"``, its reason."""
    plan.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for name in names:
        log = plan.out / f"{name}.log"
        log.write_text("", encoding="utf-8")

        def run(cmd: list[str], timeout_s: float, log: Path = log) -> str:
            with open(log, "a", encoding="utf-8") as f:
                f.write("$ " + " ".join(cmd) + "\n")
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                                  env={**os.environ, **plan.env}, timeout=timeout_s)
            with open(log, "a", encoding="utf-8") as f:
                f.write(done.stdout + done.stderr)
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
                raise RuntimeError(f"exit {done.returncode}: {tail[0][:200]}")
            return done.stdout

        t0 = time.monotonic()
        try:
            figures = CHECK_FUNCTIONS[name](plan, run)
            results[name] = {"ok": True, "seconds": round(time.monotonic() - t0, 1), **figures}
            say(f"check {name}: ok  {json.dumps(figures)}  ({results[name]['seconds']} s)")
        except NotExercised as why:
            results[name] = {"ok": None, "seconds": round(time.monotonic() - t0, 1),
                             "not_exercised": str(why)}
            say(f"check {name}: not exercised ({why})")
        except (RuntimeError, ValueError, KeyError, OSError,
                subprocess.TimeoutExpired) as err:
            results[name] = {"ok": False, "seconds": round(time.monotonic() - t0, 1),
                             "error": str(err)}
            say(f"check {name}: FAILED ({err}; the output is in {log})")
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--quick", action="store_true",
                   help="tiny budgets and models: checks the wiring, not the speed")
    p.add_argument("--only", nargs="+", choices=CHECKS, default=None, help="run these checks")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where runs and logs go (default: a new temporary folder)")
    p.add_argument("--python", default=sys.executable,
                   help="the Python that has aiayn's dependencies and torch (default: this one)")
    p.add_argument("--json", action="store_true", help="also print one JSON object at the end")
    p.add_argument("--throughput-updates", type=int, default=THROUGHPUT_UPDATES, metavar="N",
                   help="updates of the throughput check on a GPU (default %(default)s)")
    p.add_argument("--collective", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.collective:
        return collective_worker(args.device)
    import torch

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="aiayn-gpu-check-"))
    try:
        plan = make_plan(args.device, args.quick, args.python, out, torch.cuda.device_count())
    except ValueError as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2
    plan.throughput_updates = args.throughput_updates
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else \
        f"cpu ({torch.backends.cpu.get_cpu_capability()})"
    print(f"gpu_check: {where}, torch {torch.__version__}, {plan.nproc} torchrun process(es), "
          f"{'quick' if args.quick else 'full'} budgets; logs in {out}", flush=True)
    results = run_checks(plan, args.only or list(CHECKS), lambda s: print(s, flush=True))
    if args.json:
        print(json.dumps({"device": where, "quick": args.quick, "checks": results}))
    return 0 if all(r["ok"] is not False for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
