"""aiayn against CTranslate2 on a trained run's model and real test input.

Run:  AIAYN_DATA_DIR=../shared/data python bench/bench_decode_run.py --run RUN_DIR
      [--threads 1] [--beam 4] [--alphas 0 run] [--sentences 1000] [--repeat 2] [--json-out F]
      [--shortlist VMAP]

``RUN_DIR`` is a finished ``aiayn pipeline`` run of one model (the main job on the AVX2 class,
or at a short budget), or one member folder of an ensemble run (CTranslate2 has no ensembles).
Its model is exported to CTranslate2 (``aiayn convert --to ctranslate2``: the same weights,
aiayn's own vocabulary), and both engines translate the run's test set
(test_2016_flickr for Multi30k), preprocessed as the model's training text was, at the same
beam size, in batches of ``--batch-size`` sentences:

- at ``alpha 0`` both rank hypotheses by log-probability alone, the one setting where the two
  searches optimize the same score;
- at the run's own alpha (``run``: the length penalty its val choice picked), aiayn divides by
  §6.1's ((5 + |Y|) / 6)^alpha and CTranslate2 by |Y|^alpha (its ``length_penalty``): each
  engine as a user would run it at that setting.

Rows: aiayn fp32 (the reference), aiayn's default (the precision its fidelity check recorded;
int8 where val BLEU stayed within 0.2; ``--precision`` for one member's folder of an ensemble
run, whose record is the ensemble's) in one process of T threads, the same over every
output column (``all columns``: without the compact output map of a target-only output layer,
to measure that lever alone) and, at T >= 2, in T forked one-thread processes (``aiayn
translate --workers T``); CTranslate2 int8 at ``intra_threads=T``
with ``CT2_FORCE_CPU_ISA=AVX512`` (where torch found AVX-512) and at its default ISA
(``AVX2`` on a simulated AVX2 class), and at
T >= 2 with ``inter_threads=T`` (its own advice for throughput on several cores). With
``--shortlist VMAP`` (``aiayn shortlist``; opt-in, it changes outputs), two more rows: aiayn's
default with that shortlist, and CTranslate2 int8 with the same file as its own vmap
(``use_vmap=True``), their ratio printed apart. Each row gives
sentences/s (wall time, the whole test set, the fastest of ``--repeat``), the ratio to the best
CTranslate2 int8 row without a vmap, the BLEU of its output (the run's protocol: :func:`aiayn.evaluation.bleu.
corpus_bleu`), the share of sentences token-identical to aiayn fp32, and for aiayn the decoder
row-steps its searches made (:class:`aiayn.decoding.DecodeStats`; CTranslate2 reports none).
Timing starts from preprocessed text for aiayn and from pieces for CTranslate2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_peers import _cpu_class, _ct2_isas  # noqa: E402  (their one statement)


def ct2_worker(args: argparse.Namespace) -> int:
    """Child process: translate --pieces (JSON) with CTranslate2; print one JSON line."""
    import ctranslate2

    sources = json.loads(Path(args.pieces).read_text(encoding="utf-8"))
    inter = args.inter_threads
    translator = ctranslate2.Translator(args.ct2_model, device="cpu",
                                        compute_type=args.compute_type,
                                        intra_threads=args.threads // inter, inter_threads=inter)
    opts = dict(beam_size=args.beam, length_penalty=args.alpha, min_decoding_length=0,
                max_decoding_length=256, max_batch_size=args.batch_size,
                use_vmap=args.use_vmap)

    def run(batch):
        if inter == 1:
            return translator.translate_batch(batch, **opts)
        return list(translator.translate_iterable(iter(batch), batch_type="examples", **opts))

    run(sources[:16])  # warm-up
    best, best_cpu, out = float("inf"), float("inf"), None
    for _ in range(args.repeat):
        t, c = time.perf_counter(), time.process_time()
        out = run(sources)
        best = min(best, time.perf_counter() - t)
        best_cpu = min(best_cpu, time.process_time() - c)
    print(json.dumps({"seconds": best, "cpu_seconds": best_cpu,
                      "tokens": [r.hypotheses[0] for r in out]}))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", help="a finished run of one model, or one member's folder")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for every engine")
    p.add_argument("--beam", type=int, default=4, help="beam size for both engines")
    p.add_argument("--alphas", nargs="+", default=["0", "run"],
                   help="length penalties: numbers, or 'run' for the run's own choice")
    p.add_argument("--sentences", type=int, default=0, help="first N test lines (0: all)")
    p.add_argument("--batch-size", type=int, default=64, help="sentences per batch")
    p.add_argument("--repeat", type=int, default=2, help="runs per figure; the fastest is kept")
    p.add_argument("--skip", nargs="*", default=[],
                   help="systems to leave out (aiayn-fp32, aiayn-full-columns, "
                        "aiayn-workers, ct2-AVX512, ct2-default, ct2-inter)")
    p.add_argument("--shortlist", default=None, metavar="VMAP",
                   help="a vocabulary shortlist of the run (`aiayn shortlist`): adds aiayn's "
                        "default with it and CTranslate2 int8 with it as its vmap")
    p.add_argument("--precision", default=None, choices=["auto", "fp32", "bf16", "int8"],
                   help="aiayn's default row at this precision instead of the run's recorded "
                        "one (a member of an ensemble run records none of its own)")
    p.add_argument("--json-out", default=None, help="write all results here as JSON")
    p.add_argument("--work-dir", default=None, help="keep the exported model here")
    p.add_argument("--ct2-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ct2-model", help=argparse.SUPPRESS)
    p.add_argument("--pieces", help=argparse.SUPPRESS)
    p.add_argument("--compute-type", help=argparse.SUPPRESS)
    p.add_argument("--alpha", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--inter-threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--use-vmap", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ct2_worker:
        return ct2_worker(args)
    if not args.run:
        p.error("--run RUN_DIR is required")

    import torch

    torch.set_num_threads(args.threads)
    from aiayn.devices import keep_freed_memory

    keep_freed_memory()  # as `aiayn translate` does (aiayn.cli.DECODING_COMMANDS)
    from aiayn.data.splits import load_split
    from aiayn.decoding import DecodeStats
    from aiayn.evaluation.bleu import bleu_protocol, corpus_bleu
    from aiayn.model.engine import Int8Transformer
    from aiayn.interop.ctranslate2 import export_ctranslate2
    from aiayn.rundir import model_paths
    from aiayn.translator import Translator

    paths, _ = model_paths(args.run)
    if len(paths) > 1:
        p.error(f"{args.run} is an ensemble of {len(paths)} models; CTranslate2 has none: "
                f"pass one member's folder ({paths[0]})")
    translator = Translator.from_pretrained(args.run, precision=args.precision)
    config, vocab = translator.config, translator.vocab
    run_alpha = translator.decode_config.alpha
    alphas = [run_alpha if a == "run" else float(a) for a in args.alphas]
    test = load_split(config.data, "test")
    src, refs = list(test.src), list(test.tgt)
    if args.sentences:
        src, refs = src[:args.sentences], refs[:args.sentences]
    capability = torch.backends.cpu.get_cpu_capability()
    isas = _ct2_isas(torch)
    import ctranslate2

    info = {"run": str(args.run), "threads": args.threads, "beam": args.beam,
            "sentences": len(src), "batch_size": args.batch_size,
            "test_set": "test_2016_flickr" if config.data.dataset == "multi30k" else "test",
            "bleu_protocol": bleu_protocol(config.data), "run_alpha": run_alpha,
            "default_precision": translator.precision.chosen,
            "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "ctranslate2": ctranslate2.__version__, "cpu_capability": capability,
            "cpu_class": _cpu_class(torch)}
    print("; ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="aiayn-bench-run-"))
    ct2_dir = work / "ct2"
    fp32_model = Translator.from_pretrained(args.run, precision="fp32")
    export_ctranslate2(fp32_model.decoding_models[0], config, vocab, ct2_dir,
                       vmap=args.shortlist)
    shortlist = None
    if args.shortlist:
        from aiayn.decoding.shortlist import Shortlist

        shortlist = Shortlist.load(args.shortlist, vocab)
        info["shortlist"] = str(args.shortlist)
    pieces_file = work / "pieces.json"
    pieces_file.write_text(json.dumps([vocab.tokens(s) for s in src]), encoding="utf-8")
    eos = vocab.eos_id
    results = []
    for alpha in alphas:
        rows: dict[str, dict] = {}
        ref_tokens: list[list[int]] | None = None

        def record(name, seconds, ids, **extra):
            hyps = vocab.decode_batch(ids)
            row = {"alpha": alpha, "system": name, "seconds": seconds,
                   "sent_per_s": len(src) / seconds,
                   "bleu": round(corpus_bleu(hyps, refs, config.data)["bleu"], 2), **extra}
            if ref_tokens is not None:
                row["identical_to_aiayn_fp32"] = sum(
                    a == b for a, b in zip(ids, ref_tokens)) / len(src)
            rows[name] = row
            print(f"  alpha {alpha:<4} {name:<26} {row['sent_per_s']:7.1f} sent/s  "
                  f"BLEU {row['bleu']:6.2f}"
                  + (f"  identical {row['identical_to_aiayn_fp32']:.1%}"
                     if "identical_to_aiayn_fp32" in row else "")
                  + (f"  row-steps {row['row_steps']:,}" if "row_steps" in row else ""),
                  flush=True)
            return ids

        def run_aiayn(tr, workers=1, repeat=args.repeat):
            search = dict(beam_size=args.beam, alpha=alpha, batch_size=args.batch_size)
            tr.generate(src[:16], preprocessed=True, workers=workers, **search)  # warm-up
            best, out, stats = float("inf"), None, None
            for _ in range(repeat):
                stats = DecodeStats()
                t = time.perf_counter()
                out = tr.generate(src, preprocessed=True, stats=stats, workers=workers,
                                  **search)
                best = min(best, time.perf_counter() - t)
            ids = [[i for i in r[0].tokens if i != eos] for r in out]
            return best, ids, stats.row_steps

        seconds, ids, steps = run_aiayn(fp32_model, repeat=1)  # the reference: once
        ref_tokens = ids if "aiayn-fp32" in args.skip else record(
            "aiayn fp32", seconds, ids, row_steps=steps)
        seconds, ids, steps = run_aiayn(translator)
        record(f"aiayn default ({translator.precision.chosen})", seconds, ids, row_steps=steps)
        if shortlist is not None:  # opt-in: changes outputs
            translator.shortlist = shortlist
            seconds, ids, steps = run_aiayn(translator)
            translator.shortlist = None
            record("aiayn default, shortlist", seconds, ids, row_steps=steps)
        compact = [m for m in translator.decoding_models
                   if isinstance(m, Int8Transformer) and m.compact_token_ids is not None]
        if compact and "aiayn-full-columns" not in args.skip:
            # the compact output map's lever alone: the same path over every column
            kept = [m._compact_ids for m in compact]
            for m in compact:
                m._compact_ids = None
            seconds, ids, steps = run_aiayn(translator)
            for m, ids_kept in zip(compact, kept):
                m._compact_ids = ids_kept
            record("aiayn default, all columns", seconds, ids, row_steps=steps)
        if args.threads >= 2 and "aiayn-workers" not in args.skip:
            seconds, ids, steps = run_aiayn(translator, workers=args.threads)
            record(f"aiayn default {args.threads}x1", seconds, ids, row_steps=steps)
        layouts = [(isa, 1, False) for isa in isas]
        if args.threads >= 2 and "ct2-inter" not in args.skip:
            layouts.append((isas[0], args.threads, False))
        if shortlist is not None:
            layouts.append((isas[0], 1, True))
        for isa, inter, use_vmap in layouts:
            if f"ct2-{isa or 'default'}" in args.skip:
                continue
            env = {**os.environ, "CT2_VERBOSE": "1"}
            env.pop("CT2_FORCE_CPU_ISA", None)
            if isa:
                env["CT2_FORCE_CPU_ISA"] = isa
            cmd = [sys.executable, __file__, "--ct2-worker", "--ct2-model", str(ct2_dir),
                   "--pieces", str(pieces_file), "--compute-type", "int8", "--beam",
                   str(args.beam), "--alpha", str(alpha), "--threads", str(args.threads),
                   "--batch-size", str(args.batch_size), "--repeat", str(args.repeat),
                   "--inter-threads", str(inter)] + (["--use-vmap"] if use_vmap else [])
            proc = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            res = json.loads(proc.stdout)
            used = re.search(r"Selected ISA: (\S+)", proc.stderr)
            ids = [[vocab.tokenizer.token_to_id(t) for t in hyp] for hyp in res["tokens"]]
            record(f"ct2 int8 {isa or 'default'}" + (f" {inter}x1" if inter > 1 else "")
                   + (" vmap" if use_vmap else ""),
                   res["seconds"], ids, ct2_isa=used.group(1) if used else None)
        ct2 = [r for name, r in rows.items()
               if name.startswith("ct2 int8") and not name.endswith("vmap")]
        best = max(ct2, key=lambda r: r["sent_per_s"]) if ct2 else None
        if best:
            for row in rows.values():
                row["x_ct2_int8_best"] = row["sent_per_s"] / best["sent_per_s"]
            print(f"    ratio to {best['system']} (ISA {best.get('ct2_isa')}), wall time: "
                  + ", ".join(f"{r['system']} {r['x_ct2_int8_best']:.2f}"
                              for r in rows.values()), flush=True)
        vmap_rows = [r for name, r in rows.items() if name.endswith(" vmap")]
        if vmap_rows and "aiayn default, shortlist" in rows:  # both engines shortlisted
            ours = rows["aiayn default, shortlist"]
            ours["x_ct2_int8_vmap"] = ours["sent_per_s"] / vmap_rows[0]["sent_per_s"]
            print(f"    shortlisted: aiayn {ours['x_ct2_int8_vmap']:.2f}x "
                  f"{vmap_rows[0]['system']}", flush=True)
        results.extend(rows.values())
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({**info, "results": results}, indent=1),
                                       encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
