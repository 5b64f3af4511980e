"""The data pipeline at WMT14 scale (issue 56's target table): prepare, disk, re-prepare, the
start of `aiayn train`, its memory, batching an epoch and collating a batch, on a synthetic
WMT-shaped corpus (bench/make_synthetic_wmt.py).

Run:
  AIAYN_DATA_DIR=../shared/data python bench/make_synthetic_wmt.py --pairs 1000000 -o /tmp/wmt1m
  python bench/bench_data.py --corpus /tmp/wmt1m --work /tmp/bench-data [--pairs 250000]
      [--vocab DIR] [--baseline-src OLD/src] [--json]
  python bench/bench_data.py --ranks 4 --prepared DIR --work /tmp/bench-ranks [--json]

``--ranks N`` measures only the memory of N gloo training processes (``torchrun
--nproc-per-node N -m aiayn train --preset tiny``) on the prepared folder ``--prepared``: the
processes' proportional set size (``Pss`` of ``/proc/PID/smaps_rollup``, each shared page
counted once across them) summed every 0.25 s, its peak, and each process's anonymous and
file-backed share at that peak (``--global-tokens`` 12,500 a side an update, ``--steps`` 8,
validating on ``$AIAYN_DATA_DIR/wmt14-en-de/newstest2013``).

Every stage that a user runs as a command runs as one (``python -m aiayn ...``) in a process of
its own, timed wall-clock and with its peak RSS from ``wait4``. ``--baseline-src`` names the
``src`` folder of an older aiayn (e.g. a checkout of 0914548) whose `aiayn train` reads and
encodes the raw files in memory: its start and memory are measured beside the prepared path's,
in the same run. ``--pairs`` takes the first N pairs of the corpus. Without ``--vocab`` a 37k
BPE is learned from the first ``--learn-pairs`` pairs (its time and peak RSS are printed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def run_measured(cmd: list[str], env_src: Path, cwd: Path | None = None) -> dict:
    """Run ``cmd`` with ``PYTHONPATH=env_src``; wall seconds and peak RSS (GB) of the process."""
    env = {**os.environ, "PYTHONPATH": str(env_src)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"bench_data: {' '.join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}")
    return {"s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "rss_gb": usage.ru_maxrss / 1e6,
            "out": out}


def head(corpus: Path, pairs: int, work: Path) -> tuple[Path, Path]:
    """The first ``pairs`` pairs of ``corpus`` (train.en, train.de) as files under ``work``."""
    out = []
    for lang in ("en", "de"):
        src = corpus / f"train.{lang}"
        dst = work / f"train.{pairs}.{lang}"
        if not dst.is_file():
            with open(src, "rb") as f, open(dst.with_suffix(".part"), "wb") as g:
                for _ in range(pairs):
                    line = f.readline()
                    if not line:
                        break
                    g.write(line)
            os.replace(dst.with_suffix(".part"), dst)
        out.append(dst)
    return out[0], out[1]


def train_cmd(run_dir: Path, vocab: Path, sets: list[str]) -> list[str]:
    base = ["--preset", "tiny", "--run-dir", str(run_dir), "--vocab", str(vocab), "--no-progress",
            "--set", "train.max_steps=1",
            "--set", "train.eval_bleu_sentences=0", "--set", "train.checkpoint_every_steps=0",
            "--set", "train.precision=fp32", "--set", "data.dataset=files"]
    return [sys.executable, "-m", "aiayn", "train", *base, *sum((["--set", s] for s in sets), [])]


DATA_MEMORY = """
import json, sys, resource
def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * 4096 / 1e9
from aiayn.data.batching import make_batches, encode_corpus
from aiayn.data.corpus import load_parallel
from aiayn.data.vocab import Vocabulary
mode, a, b, vocab = sys.argv[1:5]
if mode == 'new':
    from aiayn.data.prepared import PreparedCorpus
before = rss()
if mode == 'new':
    data = PreparedCorpus.open(a)
else:
    data = encode_corpus(Vocabulary.load(vocab), load_parallel(a, b), 256)
batches = make_batches(data.src_lengths(), data.tgt_lengths(), 25000, seed=1, epoch=0)
print(json.dumps({'steady_gb': rss() - before,
                  'peak_gb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}))
"""


def data_memory(mode: str, a: Path, b: Path | None, vocab: Path, src_path: Path) -> dict:
    """RSS a process holds for its training pairs and one epoch's batches (after imports)."""
    m = run_measured([sys.executable, "-c", DATA_MEMORY, mode, str(a), str(b), str(vocab)],
                     src_path)
    return json.loads(m["out"].strip().splitlines()[-1])


def _cpu_class() -> str:
    """The machine's CPU, as docs/development.md names the classes."""
    info = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                  if line.startswith("model\t")), "?")
    family = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                   if line.startswith("cpu family")), "?")
    kind = "bf16 class" if "avx512_bf16" in info else "AVX2 class"
    return f"{kind}, family {family} model {model}, {os.cpu_count()} CPUs"


def data_wait(corpus, step_s: float, steps: int, workers: int = 1) -> dict:
    """The training stream (its DataLoader with ``workers`` workers) against a stand-in step
    of ``step_s`` seconds of sleep (an accelerator's step: the CPU is free meanwhile): the
    share of wall time spent waiting for the next 25k-token batch, the first batch excluded
    (the epoch's batching and the worker's start)."""
    import torch

    from aiayn.config import Config, DataConfig, TrainConfig
    from aiayn.training import stream as stream_module
    from aiayn.training.distributed import DistInfo
    from aiayn.training.state import TrainState
    from aiayn.training.stream import EpochStream

    stream_module.loader_workers = lambda _device: workers

    config = Config(data=DataConfig(max_tokens=25000), train=TrainConfig(seed=1))
    stream = EpochStream(config, None, corpus, None, DistInfo())
    state = TrainState()
    cpu = torch.device("cpu")
    t0 = time.perf_counter()
    stream.next_batch(state, cpu)
    first = time.perf_counter() - t0
    waited = 0.0
    t_all = time.perf_counter()
    for _ in range(steps):
        time.sleep(step_s)
        t0 = time.perf_counter()
        stream.next_batch(state, cpu)
        waited += time.perf_counter() - t0
    total = time.perf_counter() - t_all
    return {f"first_batch_s_{workers}": first, f"data_wait_share_{workers}": waited / total,
            "stand_in_step_s": step_s}


def in_process_figures(prepared: Path, baseline_src: Path | None, samples: int) -> dict:
    """Batching an epoch and collating 25k-token batches, new (numpy, memory map) and, with
    ``baseline_src``, old (Python loop, lists), on the same lengths and rows."""
    import numpy as np

    from aiayn.data.batching import collate, make_batch_arrays
    from aiayn.data.prepared import PreparedCorpus

    corpus = PreparedCorpus.open(prepared)
    src, tgt = corpus.src_lengths(), corpus.tgt_lengths()
    t0 = time.perf_counter()
    batches = make_batch_arrays(src, tgt, 25000, seed=1, epoch=0)
    out = {"batch_epoch_s": time.perf_counter() - t0, "batches": len(batches)}
    rng = np.random.default_rng(0)
    picked = [batches[i] for i in rng.choice(len(batches), min(samples, len(batches)),
                                              replace=False)]
    times = []
    for b in picked:
        t0 = time.perf_counter()
        collate(corpus, b, start_id=1)
        times.append(time.perf_counter() - t0)
    out["collate_median_ms"] = 1e3 * statistics.median(times)
    out["batch_tokens_median"] = int(statistics.median(int(tgt[b].sum()) for b in picked))
    out.update(data_wait(corpus, step_s=0.1, steps=60, workers=1))
    out.update(data_wait(corpus, step_s=0.1, steps=60, workers=0))
    if baseline_src is not None:
        spec = importlib.util.spec_from_file_location(
            "old_batching", baseline_src / "aiayn" / "data" / "batching.py")
        old = importlib.util.module_from_spec(spec)
        sys.modules["old_batching"] = old
        spec.loader.exec_module(old)
        t0 = time.perf_counter()
        old.make_batches(src, tgt, 25000, seed=1, epoch=0)
        out["old_batch_epoch_s"] = time.perf_counter() - t0
        times = []
        for b in picked:  # the rows of the batch as the old in-memory lists
            pairs = [corpus.pair(int(i)) for i in b]
            enc = old.EncodedCorpus([p[0] for p in pairs], [p[1] for p in pairs],
                                    list(range(len(b))))
            t0 = time.perf_counter()
            old.collate(enc, list(range(len(b))), start_id=1)
            times.append(time.perf_counter() - t0)
        out["old_collate_median_ms"] = 1e3 * statistics.median(times)
    return out


def _descendants(root: int) -> list[int]:
    """The processes below ``root`` (its children, theirs, ...), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _rollup(pid: int) -> dict[str, int]:
    """``/proc/PID/smaps_rollup``'s kB fields (empty when the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines()[1:]:
        key, _, rest = line.partition(":")
        if rest.strip().endswith("kB"):
            out[key] = int(rest.split()[0])
    return out


def ranks_memory(prepared: Path, work: Path, ranks: int, global_tokens: int, steps: int,
                 valid: str | None, src: Path = SRC) -> dict:
    """Peak summed PSS (GB) of ``ranks`` gloo training processes on ``prepared`` (the aiayn of
    ``src``), sampled every 0.25 s, with each process's anonymous and file-backed PSS at that
    peak."""
    run = work / f"run-ranks{ranks}"
    shutil.rmtree(run, ignore_errors=True)
    sets = [f"data.prepared={prepared}", "data.dataset=files", "data.max_tokens=0",
            f"data.global_max_tokens={global_tokens}", f"train.max_steps={steps}",
            "train.checkpoint_every_steps=0", "train.precision=fp32"]
    if valid:
        sets += [f"data.valid_src={valid}.en", f"data.valid_tgt={valid}.de"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", "-m", "aiayn", "train", "--preset", "tiny",
           "--run-dir", str(run), "--no-progress", *sum((["--set", s] for s in sets), [])]
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    log = work / f"ranks{ranks}.log"
    import threading

    out: list[str] = []  # the run's output, each line stamped with when it came

    def read() -> None:
        for line in proc.stdout:
            out.append(f"{time.perf_counter() - t0:8.1f} s  {line}")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    peak = {"pss_gb": 0.0}
    timeline = []  # (s, summed PSS GB, each process's anonymous PSS GB)
    while proc.poll() is None:
        procs = {pid: _rollup(pid) for pid in _descendants(proc.pid)}
        procs = {pid: r for pid, r in procs.items() if r}
        total = sum(r.get("Pss", 0) for r in procs.values()) / 1e6
        timeline.append(f"{time.perf_counter() - t0:8.1f} s  PSS {total:.3f} GB  anonymous "
                        + " ".join(f"{r.get('Pss_Anon', 0) / 1e6:.3f}" for r in procs.values()))
        if total > peak["pss_gb"]:
            peak = {"pss_gb": total, "at_s": time.perf_counter() - t0, "processes": [
                {"pss_gb": r.get("Pss", 0) / 1e6, "anon_gb": r.get("Pss_Anon", 0) / 1e6,
                 "file_gb": r.get("Pss_File", 0) / 1e6, "shmem_gb": r.get("Pss_Shmem", 0) / 1e6,
                 "rss_gb": r.get("Rss", 0) / 1e6} for r in procs.values()]}
        time.sleep(0.25)
    reader.join()
    log.write_text("".join(out))
    (work / f"ranks{ranks}.pss.txt").write_text("\n".join(timeline) + "\n")
    if proc.returncode != 0:
        raise SystemExit(f"bench_data: {' '.join(cmd)} failed ({proc.returncode}); see {log}")
    return {"ranks": ranks, "global_tokens": global_tokens, "steps": steps,
            "valid": valid, "s": time.perf_counter() - t0, **peak}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", type=Path, help="folder of train.en, train.de")
    p.add_argument("--ranks", type=int, default=0,
                   help="only the summed PSS of this many gloo training processes")
    p.add_argument("--prepared", type=Path, help="the prepared folder --ranks trains on")
    p.add_argument("--global-tokens", type=int, default=12500)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--src", type=Path, default=SRC,
                   help="the src/ folder of the aiayn --ranks runs (default: this one)")
    p.add_argument("--work", type=Path, required=True, help="scratch folder")
    p.add_argument("--pairs", type=int, default=0, help="the first N pairs; 0: all")
    p.add_argument("--vocab", type=Path, default=None, help="a vocabulary (tokenizer.json)")
    p.add_argument("--learn-pairs", type=int, default=300_000)
    p.add_argument("--vocab-size", type=int, default=37000)
    p.add_argument("--baseline-src", type=Path, default=None,
                   help="src/ of an aiayn whose train encodes in memory: measured beside")
    p.add_argument("--skip-new", action="store_true", help="only the baseline's train")
    p.add_argument("--collate-samples", type=int, default=200)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    if args.ranks:
        if args.prepared is None:
            p.error("--ranks needs --prepared")
        data_dir = os.environ.get("AIAYN_DATA_DIR")
        valid = f"{data_dir}/wmt14-en-de/newstest2013" if data_dir else None
        r = ranks_memory(args.prepared.resolve(), work.resolve(), args.ranks,
                         args.global_tokens, args.steps, valid, args.src.resolve())
        r["cpu"] = _cpu_class()
        if args.json:
            print(json.dumps(r))
            return 0
        print(f"{args.ranks} gloo ranks, `tiny`, {args.global_tokens:,} tokens an update, "
              f"{args.steps} steps, validating on {valid or 'nothing'} ({r['cpu']}): peak summed "
              f"PSS {r['pss_gb']:.3f} GB at {r['at_s']:.1f} s of {r['s']:.1f} s")
        for q in sorted(r["processes"], key=lambda q: -q["pss_gb"]):
            print(f"  process: PSS {q['pss_gb']:.3f} GB = anonymous {q['anon_gb']:.3f} + "
                  f"file {q['file_gb']:.3f} + shmem {q['shmem_gb']:.3f} (RSS {q['rss_gb']:.3f})")
        return 0
    if args.corpus is None:
        p.error("--corpus is required (or --ranks with --prepared)")
    if args.pairs:
        src, tgt = head(args.corpus, args.pairs, work)
    else:
        src, tgt = args.corpus / "train.en", args.corpus / "train.de"
    with open(src, "rb") as f:
        pairs = sum(1 for _ in f)
    r: dict = {"pairs": pairs, "cpus": os.cpu_count(),
               "bf16_class": "avx512_bf16" in Path("/proc/cpuinfo").read_text()}
    vocab = args.vocab
    if vocab is None:
        vocab = work / f"vocab{args.vocab_size}"
        if not (vocab / "tokenizer.json").is_file():
            ls, lt = head(args.corpus, args.learn_pairs, work)
            code = ("import sys; from aiayn.data.vocab import Vocabulary; "
                    "t = [l.strip() for p in sys.argv[1:3] for l in open(p, encoding='utf-8')]; "
                    f"Vocabulary.learn(t, {args.vocab_size}, 'bpe').save(sys.argv[3])")
            m = run_measured([sys.executable, "-c", code, str(ls), str(lt), str(vocab)], SRC)
            r["learn"] = {"pairs": args.learn_pairs, "s": m["s"], "cpu_s": m["cpu_s"],
                          "rss_gb": m["rss_gb"]}
    prepared = work / f"prepared.{pairs}"
    if not args.skip_new:
        shutil.rmtree(prepared, ignore_errors=True)
        prep = [sys.executable, "-m", "aiayn", "prepare", "--src", str(src), "--tgt", str(tgt),
                "--vocab", str(vocab), "-o", str(prepared)]
        m = run_measured(prep, SRC)
        manifest = json.loads((prepared / "manifest.json").read_text())
        c = manifest["counts"]
        r["prepare"] = {"s": m["s"], "cpu_s": m["cpu_s"], "rss_gb": m["rss_gb"],
                        "sentences_per_s": 2 * c["lines"] / m["s"], "kept": c["kept"],
                        "tokens_per_sentence": (c["src_tokens"] + c["tgt_tokens"]) / (2 * c["kept"])}
        disk = sum(f.stat().st_size for f in prepared.iterdir() if f.name.endswith(".bin"))
        tokens = c["src_tokens"] + c["tgt_tokens"]
        r["disk"] = {"bytes": disk, "bytes_per_token": disk / tokens,
                     "bytes_per_sentence_beyond_2_per_token": (disk - 2 * tokens) / (2 * c["kept"])}
        m = run_measured(prep, SRC)
        r["reprepare"] = {"s": m["s"], "cpu_s": m["cpu_s"]}
        run = work / "run-new"
        shutil.rmtree(run, ignore_errors=True)
        m = run_measured(train_cmd(run, vocab, [f"data.prepared={prepared}"]), SRC)
        r["train_new"] = {"s": m["s"], "cpu_s": m["cpu_s"], "rss_gb": m["rss_gb"]}
        # the same process on a 1,000-pair corpus: what the data adds
        small_src, small_tgt = head(args.corpus, 1000, work)
        small = work / "prepared.small"
        run_measured([sys.executable, "-m", "aiayn", "prepare", "--src", str(small_src),
                      "--tgt", str(small_tgt), "--vocab", str(vocab), "-o", str(small)], SRC)
        shutil.rmtree(run, ignore_errors=True)
        m = run_measured(train_cmd(run, vocab, [f"data.prepared={small}"]), SRC)
        r["train_new"]["small_rss_gb"] = m["rss_gb"]
        r["data_new"] = data_memory("new", prepared, None, vocab, SRC)
        sys.path.insert(0, str(SRC))
        r.update(in_process_figures(prepared, args.baseline_src, args.collate_samples))
    if args.baseline_src is not None:
        run = work / "run-old"
        shutil.rmtree(run, ignore_errors=True)
        m = run_measured(train_cmd(run, vocab, [f"data.train_src={src}",
                                                f"data.train_tgt={tgt}"]), args.baseline_src)
        r["train_old"] = {"s": m["s"], "cpu_s": m["cpu_s"], "rss_gb": m["rss_gb"]}
        r["data_old"] = data_memory("old", src, tgt, vocab, args.baseline_src)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"{pairs:,} synthetic WMT-shaped pairs; {r['cpus']} CPUs, "
          f"{'bf16' if r['bf16_class'] else 'AVX2'} class, measured beside other work "
          "(wall s, and CPU s of the process)")
    if "learn" in r:
        L = r["learn"]
        print(f"  learn a {args.vocab_size} BPE on {L['pairs']:,} pairs  {L['s']:8.1f} s "
              f"({L['cpu_s']:.1f} CPU s)  peak RSS {L['rss_gb']:.2f} GB")
    if "prepare" in r:
        P, D = r["prepare"], r["disk"]
        print(f"  prepare                 {P['s']:8.1f} s ({P['cpu_s']:.1f} CPU s) "
              f"{P['sentences_per_s']:10,.0f} sentences/s  peak RSS {P['rss_gb']:.2f} GB  "
              f"({P['tokens_per_sentence']:.1f} tokens a sentence)")
        print(f"  on disk                 {D['bytes_per_token']:8.2f} bytes a token "
              f"(2 a token + {D['bytes_per_sentence_beyond_2_per_token']:.1f} a sentence)")
        print(f"  prepare again           {r['reprepare']['s']:8.2f} s "
              f"({r['reprepare']['cpu_s']:.2f} CPU s)")
        T, M = r["train_new"], r["data_new"]
        print(f"  train, start to step 1  {T['s']:8.1f} s ({T['cpu_s']:.1f} CPU s)  peak RSS "
              f"{T['rss_gb']:.2f} GB (1,000 pairs: {T['small_rss_gb']:.2f} GB)")
        print(f"  data memory             {M['steady_gb']:8.2f} GB held (peak RSS of the "
              f"process {M['peak_gb']:.2f} GB)")
        print(f"  batching an epoch       {r['batch_epoch_s']:8.2f} s  ({r['batches']} batches "
              "of <= 25,000 tokens)")
        print(f"  collate a batch         {r['collate_median_ms']:8.2f} ms median "
              f"({r['batch_tokens_median']:,} target tokens)")
        for w in (1, 0):
            print(f"  data wait, {w} worker(s)  {100 * r[f'data_wait_share_{w}']:7.2f} % of a "
                  f"{r['stand_in_step_s']:.1f} s stand-in step (first batch "
                  f"{r[f'first_batch_s_{w}']:.2f} s)")
    if "train_old" in r:
        old, M = r["train_old"], r["data_old"]
        print(f"  OLD train, start to step 1  {old['s']:8.1f} s ({old['cpu_s']:.1f} CPU s)  peak "
              f"RSS {old['rss_gb']:.2f} GB")
        print(f"  OLD data memory         {M['steady_gb']:8.2f} GB held (peak RSS "
              f"{M['peak_gb']:.2f} GB)")
    if "old_batch_epoch_s" in r:
        print(f"  OLD batching an epoch   {r['old_batch_epoch_s']:8.2f} s; collate "
              f"{r['old_collate_median_ms']:.2f} ms median")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
