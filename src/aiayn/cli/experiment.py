"""``aiayn experiment``: the paper's experiments as commands — ``table3`` (the model
variations of §6.2, trained for the same time each) and ``table1`` (§4's per-layer costs,
measured on this machine)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from aiayn.errors import UserError

HELP = ("Run the paper's experiments: `table3` (Table 3's variations on a corpus, equal time "
        "each) or `table1` (Table 1's layer costs measured, with fitted exponents).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from aiayn.cli import _HelpFormatter

    sub = p.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True,
                           help="table3 or table1")
    t3 = sub.add_parser("table3", formatter_class=_HelpFormatter,
                        help="train every Table 3 variation for the same time; print the table",
                        description="Train each Table 3 row (scaled to --scale's preset) for "
                                    "--minutes-per-row, score dev perplexity and dev BLEU (beam "
                                    "4, alpha 0.6, no averaging; the Multi30k protocol on "
                                    "Multi30k, else sacreBLEU) and write table3.md, "
                                    "table3.json and table3.png. Resumable: rerun the same "
                                    "command to continue.")
    t3.add_argument("--dataset", default=None,
                    help="corpus (multi30k, wmt14-en-de, files); default: the --scale preset's")
    t3.add_argument("--scale", default="multi30k", metavar="PRESET",
                    help="the preset playing the paper's base row (base reproduces the "
                         "paper's rows exactly)")
    t3.add_argument("--rows", default="all",
                    help="comma-separated rows among base,A1..A4,B1,B2,C1..C7,D1..D4,E,R "
                         "(R: restricted self-attention, §4), or all")
    t3.add_argument("--minutes-per-row", type=float, required=True, metavar="M",
                    help="training minutes for each row")
    t3.add_argument("--window", type=int, default=4, metavar="R",
                    help="r of row R: positions on either side each position attends to")
    t3.add_argument("--dev-sentences", type=int, default=0, metavar="K",
                    help="score dev BLEU on the first K dev pairs (0: all); perplexity always "
                         "uses the whole dev set")
    t3.add_argument("--out", default="runs/table3", metavar="DIR",
                    help="output folder (rows/, table3.md, table3.json, table3.png)")
    t3.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="override a field of the base preset before scaling (repeatable)")
    t3.add_argument("--base-seeds", type=int, default=1, metavar="K",
                    help="train the base row K times (train.seed, seed + 1, …); the table "
                         "gives their spread and marks (†) rows more than twice it from base")
    t3.add_argument("--parallel", type=int, default=1, metavar="P",
                    help="rows trained at once, each a process of --threads threads (2 on a "
                         "2-core machine, one thread each, as the ensemble trains)")
    t3.add_argument("--threads", type=int, default=None, metavar="T",
                    help="torch threads of each row's process (default: torch's choice with "
                         "--parallel 1, else 1)")
    t3.add_argument("--job", default=None, help=argparse.SUPPRESS)  # one row, in a child
    t3.add_argument("--device", default=None, help="cpu, cuda or cuda:N")
    t3.add_argument("--no-progress", action="store_true", help="no progress bars")
    t3.add_argument("--json", action="store_true", help="print the rows as JSON")

    t1 = sub.add_parser("table1", formatter_class=_HelpFormatter,
                        help="measure one layer of each kind of Table 1 against n",
                        description="Time forward + backward of self-attention, restricted "
                                    "self-attention, an LSTM and a Conv1d layer at each n; fit "
                                    "the growth exponents; write table1.md, table1.json and "
                                    "table1.png (log-log).")
    t1.add_argument("--n", type=int, nargs="+", default=[2**i for i in range(4, 13)],
                    metavar="N", help="sequence lengths (default: 16 32 … 4096)")
    t1.add_argument("--d", type=int, default=512, help="representation size d (d_model)")
    t1.add_argument("--h", type=int, default=8, help="attention heads")
    t1.add_argument("--r", type=int, default=16, help="window of restricted self-attention")
    t1.add_argument("--k", type=int, default=3, help="convolution kernel size")
    t1.add_argument("--repeats", type=int, default=3, help="timed runs per point (median)")
    t1.add_argument("--max-seconds", type=float, default=60.0, metavar="S",
                    help="stop growing n for a layer once one of its runs takes longer")
    t1.add_argument("--fit-top", type=int, default=4, metavar="K",
                    help="fit the exponent over the K largest n")
    t1.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    t1.add_argument("--out", default="runs/table1", metavar="DIR",
                    help="output folder (table1.md, table1.json, table1.png)")
    t1.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    t1.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    return _table3(args) if args.experiment == "table3" else _table1(args)


def _table3(args: argparse.Namespace) -> int:
    from aiayn.checkpoint import write_json_atomic
    from aiayn.fileio import write_atomic
    from aiayn.config import load_config
    from aiayn.evaluation.bleu import PROTOCOLS
    from aiayn.experiments.table3 import (base_spread, job_names, markdown_table, parse_rows,
                                          pending_jobs, plot_bleu, prepare_table3, run_table3)

    def say(msg: str) -> None:
        if not args.json:
            print(msg, flush=True)

    if args.minutes_per_row <= 0:
        raise UserError(f"--minutes-per-row must be positive, got {args.minutes_per_row}")
    if args.window < 1:
        raise UserError(f"--window must be >= 1, got {args.window}")
    for name, value in (("--base-seeds", args.base_seeds), ("--parallel", args.parallel)):
        if value < 1:
            raise UserError(f"{name} must be at least 1, got {value}")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be at least 1, got {args.threads}")
    rows = parse_rows(args.rows)
    job_names(rows, args.base_seeds)  # fails on seeds without the base row, before any work
    overrides = list(args.set) + ([f"data.dataset={args.dataset}"] if args.dataset else [])
    base = load_config(args.scale, overrides)
    out = Path(args.out)
    threads = args.threads or (1 if args.parallel > 1 else None)
    if threads:
        import torch

        torch.set_num_threads(threads)
    if args.job is not None:  # one job, in a process the parent started
        run_table3(base, out, rows, minutes_per_row=args.minutes_per_row, window=args.window,
                   dev_sentences=args.dev_sentences, base_seeds=args.base_seeds,
                   only=[args.job], device=args.device, progress=False, log=say)
        return 0
    if args.parallel > 1:
        prepare_table3(base, out, say)
        _run_jobs_in_parallel(args, pending_jobs(out, rows, args.base_seeds), threads, say)
    results = run_table3(base, out, rows, minutes_per_row=args.minutes_per_row,
                         window=args.window, dev_sentences=args.dev_sentences,
                         base_seeds=args.base_seeds, device=args.device,
                         progress=not args.no_progress, log=say)
    k = results[0]["dev_bleu_sentences"] if results else 0
    protocol = PROTOCOLS.get(results[0].get("bleu_protocol", ""), "sacreBLEU") \
        if results else "-"
    title = (f"Table 3 variations on {base.data.dataset} ({base.data.src_lang}->"
             f"{base.data.tgt_lang}), scaled from preset {args.scale}, {args.minutes_per_row:g} "
             f"min per row; dev PPL per subword on the whole validation set; dev BLEU "
             f"({protocol}) on {k} pairs, beam 4, alpha 0.6, no averaging")
    write_json_atomic(out / "table3.json", {"title": title, "rows": results,
                                            "base_spread": base_spread(results)})
    table = markdown_table(results, title)
    write_atomic(out / "table3.md", table)
    plot_bleu(results, out / "table3.png",
              f"{base.data.dataset}, {args.minutes_per_row:g} min/row, scaled from {args.scale}")
    if args.json:
        print(json.dumps(results))
    else:
        print("\n" + table)
        print(f"wrote {out / 'table3.md'}, {out / 'table3.json'}, {out / 'table3.png'}")
    return 0


def _run_jobs_in_parallel(args: argparse.Namespace, jobs: list[str], threads: int,
                          say) -> None:
    """Train ``jobs`` ``args.parallel`` at a time, each in a child ``aiayn experiment table3
    --job JOB`` process of ``threads`` threads logging to ``OUT/rows/JOB.log``.

    Raises:
        UserError: a job that failed (the end of its log quoted); the others are stopped first.
    """
    import os
    import subprocess
    import sys

    argv = [sys.executable, "-m", "aiayn", "experiment", "table3", "--scale", args.scale,
            "--rows", args.rows, "--minutes-per-row", str(args.minutes_per_row),
            "--window", str(args.window), "--dev-sentences", str(args.dev_sentences),
            "--base-seeds", str(args.base_seeds), "--out", str(args.out),
            "--threads", str(threads), "--no-progress"]
    argv += ["--dataset", args.dataset] if args.dataset else []
    argv += ["--device", args.device] if args.device else []
    for item in args.set:
        argv += ["--set", item]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    todo, running = list(jobs), {}
    logs = Path(args.out) / "rows"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        while todo or running:
            while todo and len(running) < args.parallel:
                job = todo.pop(0)
                log = (logs / f"{job}.log").open("a", encoding="utf-8")
                say(f"table3: row {job} started ({threads} thread(s); log {logs / job}.log)")
                running[job] = (subprocess.Popen([*argv, "--job", job], stdout=log,
                                                 stderr=subprocess.STDOUT, env=env), log)
            time.sleep(1.0)
            for job, (proc, log) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.close()
                del running[job]
                if proc.returncode != 0:
                    tail = (logs / f"{job}.log").read_text(encoding="utf-8")[-800:]
                    raise UserError(f"table3: row {job} failed (exit {proc.returncode}); the "
                                    f"end of {logs / job}.log:\n{tail}")
                say(f"table3: row {job} finished")
    finally:
        for proc, log in running.values():
            proc.terminate()
            proc.wait()
            log.close()


def _table1(args: argparse.Namespace) -> int:
    import torch

    from aiayn.checkpoint import write_json_atomic
    from aiayn.fileio import write_atomic
    from aiayn.experiments.table1 import LAYERS, markdown, measure, plot, summarize

    for name, value in (("--threads", args.threads), ("--repeats", args.repeats),
                        ("--n", min(args.n)), ("--d", args.d), ("--h", args.h), ("--r", args.r),
                        ("--k", args.k)):
        if value < 1:
            raise UserError(f"{name} must be >= 1, got {value}")
    if args.d % args.h:
        raise UserError(f"--d {args.d} is not divisible by --h {args.h} (d_k = d / h)")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records, stopped = [], set()
    t_start = time.monotonic()
    for n in sorted(set(args.n)):
        for kind in LAYERS:
            if kind in stopped:
                continue
            rec = measure(kind, n, args.d, h=args.h, r=args.r, k=args.k, repeats=args.repeats,
                          device=args.device)
            records.append(rec)
            if not args.json:
                print(f"table1: n={n:5d} {kind:26s} {rec['time_s'] * 1e3:10.2f} ms  "
                      f"{rec['saved_bytes'] / 2**20:9.1f} MiB saved", flush=True)
            if rec["time_s"] > args.max_seconds:
                stopped.add(kind)
    summary = summarize(records, args.fit_top)
    meta = {"d": args.d, "h": args.h, "r": args.r, "k": args.k, "threads": args.threads,
            "device": args.device, "repeats": args.repeats, "fit_top": args.fit_top,
            "wall_s": round(time.monotonic() - t_start, 1)}
    write_json_atomic(out / "table1.json", {"settings": meta, "summary": summary,
                                            "records": records})
    table = markdown(summary)
    write_atomic(out / "table1.md", table)
    plot(records, summary, out / "table1.png",
         f"one layer, forward + backward, d={args.d}, h={args.h}, r={args.r}, k={args.k}, "
         f"{args.threads} thread(s) on {args.device}")
    if args.json:
        print(json.dumps({"settings": meta, "summary": summary}))
    else:
        print("\n" + table)
        print(f"wrote {out / 'table1.md'}, {out / 'table1.json'}, {out / 'table1.png'}")
    return 0
