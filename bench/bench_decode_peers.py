"""aiayn against Hugging Face ``generate`` and CTranslate2, decoding the same weights.

Run:  AIAYN_DATA_DIR=../shared/data python bench/bench_decode_peers.py [--models base multi30k]
      [--searches greedy beam4] [--threads 2] [--sentences 256] [--rounds 5] [--json-out FILE]

One random-weight Hugging Face ``MarianMTModel`` per size (``base``: d_model 512, 6+6 layers,
8 heads, d_ff 2048; ``multi30k``: aiayn's preset, 3+3 layers, d_model 256), relu FFN, with a
SentencePiece vocabulary of 8000 pieces learned on Multi30k train (en+de, shared). The same
weights are imported into aiayn (``aiayn.interop.marian.import_hf``) and exported to
CTranslate2 through its converter (``aiayn convert --to ctranslate2``). Every system decodes the
first ``--sentences`` lines of Multi30k test_2016_flickr.en (sorted by length, batches of
``--batch-size``), and every output is forced to exactly ``--length`` tokens plus EOS (25 decoder
steps): aiayn with ``min_len``/``max_len``, ``generate`` with ``min_new_tokens``/
``max_new_tokens``, CTranslate2 with ``min_decoding_length = max_decoding_length``.

Systems: ``aiayn.Translator`` at precision fp32 (the reference), bf16 (autocast), int8
(``aiayn.model.quantize``) and at its default (``aiayn default``: decoding's ``auto`` on this
machine, the row says which; a finished run decodes as its fidelity check recorded, which is
int8 where auto picks it and val BLEU stays within 0.2, while these untrained models, with no
record, would get fp32);
Hugging Face fp32 and bf16 weights; CTranslate2 fp32 and int8, each
with ``CT2_FORCE_CPU_ISA=AVX512`` and at its default ISA (each CTranslate2 figure runs in a
child process, since the ISA is fixed when the library loads). Tokenization is outside the
timed region for the peers and inside it for aiayn (``translate_nbest`` from text).

With ``--device cuda`` every system runs on the GPU (aiayn int8, a CPU path, and
CTranslate2's ISA variants left out). On a CPU without AVX-512 the AVX512 variant is skipped (it
would die of an illegal instruction); on a simulated AVX2 class CTranslate2 runs with
``CT2_FORCE_CPU_ISA=AVX2`` (its own kernels held to AVX2, as its oneDNN products are by
``ONEDNN_MAX_CPU_ISA``; aiayn's numba kernels compile for the host CPU unless
``NUMBA_CPU_NAME=znver3 NUMBA_CPU_FEATURES=+avx2`` holds them to AVX2 too (the name alone does
not: numba passes the host's features with it), and FBGEMM, which aiayn's int8 copy runs
for the maps a probe finds faster there, picks AVX-512 unless
``FBGEMM_ENABLE_INSTRUCTIONS=AVX2``: a faithful simulation sets all three; the bench records
whether numba's target has AVX-512, ``numba_avx512``); and on a CPU without
native bf16 the bf16 systems are skipped (emulated bf16 runs 5-45x slower than fp32 there).

With ``--threads T`` >= 2, each engine also runs at its own best layout for T cores:
CTranslate2 int8 with ``inter_threads=T, intra_threads=1`` (T one-thread translators over one
model, fed by ``translate_iterable``: its parallelism docs' advice for throughput), and aiayn's
default in T forked one-thread processes over the one model (``aiayn default Tx1``, as
``aiayn translate --workers T`` decodes, forked for each call), each decoding every T-th batch,
and in T one-thread processes forked once before the timed region (``aiayn default Tx1 pool``,
as ``aiayn serve`` keeps them), each taking the next batch as it frees up.

For each model size and search it prints sentences/s (wall time), sentences per CPU second
(one-process rows: on a machine shared with other work, CPU time is the steadier figure), the
ratio to CTranslate2 int8 at its best ISA and thread layout measured in the same run, the
decoder row-steps of aiayn's searches (:class:`aiayn.decoding.DecodeStats`: rows fed to the
decoder, summed over steps; CTranslate2 does not report its own), and for every path the share
of sentences token-identical to aiayn fp32. On a shared machine, compare ratios within one run
only.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {"base": dict(N=6, d_model=512, h=8, d_ff=2048)}


def _read(path: Path, limit: int | None = None) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = [line.strip() for line in f]
    return lines[:limit] if limit else lines


def _cpu_class(torch) -> str:
    """The CPU class as torch sees it: the bf16 class (AVX-512 with native bf16) or the AVX2
    class, real or simulated (ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA set)."""
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "bf16 class"
    simulated = any(os.environ.get(v) for v in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"))
    return f"{torch.backends.cpu.get_cpu_capability()} class" + (" (simulated)" if simulated
                                                                  else "")


def _ct2_isas(torch) -> list[str | None]:
    """The ``CT2_FORCE_CPU_ISA`` values to run CTranslate2 under (None: its own choice).
    Where torch found AVX-512: AVX512 and CTranslate2's default. On a simulated AVX2 class
    (``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA`` set on an AVX-512 CPU): AVX2, so that
    CTranslate2's own kernels are held to AVX2 as aiayn's are, not only its oneDNN products.
    Elsewhere its default (AVX512 there would die of an illegal instruction)."""
    if "AVX512" in torch.backends.cpu.get_cpu_capability():
        return ["AVX512", None]
    simulated = any(os.environ.get(v) for v in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"))
    return ["AVX2"] if simulated else [None]


def build_marian(out: Path, dims: dict, spm_model: Path, seed: int = 0) -> Path:
    """A random-weight MarianMTModel directory with the shared SentencePiece model."""
    import sentencepiece as spm
    import torch
    from transformers import MarianConfig, MarianMTModel

    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    vocab = {"</s>": 0, "<unk>": 1}
    for i in range(sp.get_piece_size()):
        p = sp.id_to_piece(i)
        if p not in vocab:
            vocab[p] = len(vocab)
    vocab["<pad>"] = pad = len(vocab)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("source.spm", "target.spm"):
        (out / name).write_bytes(spm_model.read_bytes())
    (out / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "MarianTokenizer", "separate_vocabs": False}), encoding="utf-8")
    d = dims["d_model"]
    config = MarianConfig(
        vocab_size=len(vocab), d_model=d, encoder_layers=dims["N"], decoder_layers=dims["N"],
        encoder_attention_heads=dims["h"], decoder_attention_heads=dims["h"],
        encoder_ffn_dim=dims["d_ff"], decoder_ffn_dim=dims["d_ff"], activation_function="relu",
        max_position_embeddings=256, scale_embedding=True, pad_token_id=pad, eos_token_id=0,
        decoder_start_token_id=pad, forced_eos_token_id=0)
    torch.manual_seed(seed)
    model = MarianMTModel(config).eval()
    with torch.no_grad():  # peaked next-token distributions, as a trained model has
        for name, p in model.named_parameters():
            if "embed_tokens" in name or "shared" in name:
                p.normal_(0.0, 0.5)
            elif p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
        model.model.encoder.embed_tokens.weight[pad] = 0.0
    model.save_pretrained(out)
    return out


def ct2_worker(args: argparse.Namespace) -> int:
    """Child process: time CTranslate2 on the pieces in --pieces (JSON); print one JSON line."""
    import ctranslate2

    batches = json.loads(Path(args.pieces).read_text(encoding="utf-8"))
    inter = args.inter_threads
    # inter_threads > 1: that many one-thread translators over one model, fed by
    # translate_iterable (CTranslate2's own advice for throughput on several cores)
    translator = ctranslate2.Translator(args.ct2_model, device=args.device or "cpu",
                                        compute_type=args.compute_type,
                                        intra_threads=args.threads // inter, inter_threads=inter)
    opts = dict(beam_size=args.beam, length_penalty=0.0, min_decoding_length=args.length + 1,
                max_decoding_length=args.length + 1, max_batch_size=args.batch_size)

    def run(sources):
        if inter == 1:
            return translator.translate_batch(sources, **opts)
        return list(translator.translate_iterable(iter(sources), batch_type="examples",
                                                  **opts))

    run(batches[:8])  # warm-up
    best, best_cpu, out = float("inf"), float("inf"), None
    for _ in range(args.repeat):
        t, c = time.perf_counter(), time.process_time()
        out = run(batches)
        best = min(best, time.perf_counter() - t)
        best_cpu = min(best_cpu, time.process_time() - c)
    lengths = {len(r.hypotheses[0]) for r in out}
    print(json.dumps({"seconds": best, "cpu_seconds": best_cpu, "lengths": sorted(lengths),
                      "isa": os.environ.get("CT2_FORCE_CPU_ISA", "default"),
                      "tokens": [r.hypotheses[0] for r in out]}))
    return 0


def _print_medians(results: list[dict]) -> None:
    """Each system's ratio to CTranslate2 int8 per CPU second (wall time where there is no
    CPU figure), its median over the rounds and every round's, a line per model, search and
    system."""
    import statistics

    groups: dict[tuple, list[float]] = {}
    for row in results:
        ratio = row.get("x_ct2_int8_best_cpu", row.get("x_ct2_int8_best"))
        if ratio is not None:
            groups.setdefault((row["model"], row["search"], row["system"]), []).append(ratio)
    print("median over the rounds of the ratio to CTranslate2 int8 (per CPU second where "
          "measured), each round's in brackets:")
    for (size, search, system), ratios in groups.items():
        print(f"  {size:>8} {search:>6} {system:<24} {statistics.median(ratios):5.2f}  ["
              + " ".join(f"{r:.2f}" for r in ratios) + "]", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["base", "multi30k"],
                   help="model shapes: base (d_model 512, 6+6) and/or multi30k (the preset)")
    p.add_argument("--searches", nargs="+", default=["greedy", "beam4"],
                   help="greedy and/or beam4")
    p.add_argument("--sentences", type=int, default=256,
                   help="source sentences from test_2016_flickr.en")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per batch")
    p.add_argument("--length", type=int, default=24, help="output tokens before EOS")
    p.add_argument("--threads", type=int, default=2,
                   help="CPU threads for every system (torch and CTranslate2)")
    p.add_argument("--repeat", type=int, default=1, help="runs per figure; the fastest is kept")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every system this many times in turn, and report each ratio's "
                        "median over the rounds (a machine whose speed drifts by 10%% between "
                        "minutes slows the systems of a round alike, not one system's runs)")
    p.add_argument("--skip", nargs="*", default=[],
                   help="systems to leave out (e.g. hf-fp32 hf-bf16 ct2-default)")
    p.add_argument("--device", default=None,
                   help="cpu or cuda (default: cpu); on CUDA every system runs on the GPU, "
                        "aiayn int8 (a CPU path) and CTranslate2's ISA variants are left out")
    p.add_argument("--json-out", default=None, help="write all results here as JSON")
    p.add_argument("--work-dir", default=None, help="keep the built models here")
    # child-process mode (CTranslate2 under a chosen ISA)
    p.add_argument("--ct2-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ct2-model", help=argparse.SUPPRESS)
    p.add_argument("--pieces", help=argparse.SUPPRESS)
    p.add_argument("--compute-type", help=argparse.SUPPRESS)
    p.add_argument("--beam", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--inter-threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ct2_worker:
        return ct2_worker(args)

    import sentencepiece as spm
    import torch

    torch.set_num_threads(args.threads)
    from aiayn.devices import keep_freed_memory

    keep_freed_memory()  # as `aiayn translate` does (aiayn.cli.DECODING_COMMANDS)
    from aiayn.devices import choose_device

    device = choose_device(args.device or "cpu")
    on_gpu = device.type == "cuda"
    cuda_sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    from aiayn.config import load_config
    from aiayn.interop.ctranslate2 import export_ctranslate2
    from aiayn.interop.marian import import_hf
    from aiayn.decoding import DecodeStats
    from aiayn.translator import Translator
    from aiayn.model import kernels
    # CT2_FORCE_CPU_ISA=AVX512 on a CPU without AVX-512 dies of an illegal instruction: that
    # variant runs only where torch found AVX-512 (ATEN_CPU_CAPABILITY=avx2 simulates its absence)
    capability = torch.backends.cpu.get_cpu_capability()
    isas: list[str | None] = [None] if on_gpu else _ct2_isas(torch)
    if not on_gpu and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        print(f"no native bf16 on this CPU ({capability}): aiayn bf16 and hf bf16 left out")
        args.skip = [*args.skip, "aiayn-bf16", "hf-bf16"]

    data = os.environ.get("AIAYN_DATA_DIR")
    if not data:
        p.error("set AIAYN_DATA_DIR (the shared data folder holding multi30k/)")
    m30k = Path(data) / "multi30k"
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="aiayn-peers-"))
    work.mkdir(parents=True, exist_ok=True)
    spm_model = work / "spm8000.model"
    if not spm_model.is_file():
        train = _read(m30k / "train.en.gz") + _read(m30k / "train.de.gz")
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(train), model_prefix=str(work / "spm8000"), vocab_size=8000,
            model_type="unigram", bos_id=-1, eos_id=-1, unk_id=0, pad_id=-1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    lines = _read(m30k / "test_2016_flickr.en.gz", args.sentences)
    lines.sort(key=lambda s: -len(sp.encode(s)))  # the batches aiayn forms, for every system
    pieces = [sp.encode(s, out_type=str) + ["</s>"] for s in lines]
    pieces_file = work / "pieces.json"
    pieces_file.write_text(json.dumps(pieces), encoding="utf-8")

    sizes = dict(SIZES)
    m = load_config("multi30k").model
    sizes["multi30k"] = dict(N=m.N, d_model=m.d_model, h=m.h, d_ff=m.d_ff)
    info = {"threads": args.threads, "sentences": len(lines), "batch_size": args.batch_size,
            "output_tokens": args.length + 1, "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if on_gpu
            else "cpu", "cpu_capability": capability,
            "cpu_native_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            "cpu_class": _cpu_class(torch),
            "numba_cpu": os.environ.get("NUMBA_CPU_NAME") or "host",
            "numba_avx512": kernels.numba_target_has("avx512f"),
            "fbgemm_isa": os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS") or "host",
            "note": "measured on a shared 2-core machine: compare ratios within one run"}
    if "simulated" in info["cpu_class"] and info["numba_avx512"]:
        print("note: aiayn's numba kernels compile for this CPU (AVX-512) whatever torch is "
              "held to; set NUMBA_CPU_NAME=znver3 NUMBA_CPU_FEATURES=+avx2 to hold them to "
              "AVX2 too", flush=True)
    if "simulated" in info["cpu_class"] and not os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS"):
        print("note: FBGEMM (aiayn's packed int8 maps, where faster) picks its kernels from "
              "this CPU; set FBGEMM_ENABLE_INSTRUCTIONS=AVX2 to hold it to AVX2 too", flush=True)
    try:
        import ctranslate2
        import transformers
        info.update(transformers=transformers.__version__, ctranslate2=ctranslate2.__version__)
    except ImportError as err:
        p.error(f"needs the interop extra (pip install -e '.[interop]'): {err}")
    results: list[dict] = []
    skipped: list[dict] = []  # peers that could not run here, and why
    print("; ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    for size in args.models:
        hf_dir = work / f"hf-{size}"
        if not (hf_dir / "config.json").is_file():
            build_marian(hf_dir, sizes[size], spm_model)
        model, config, vocab = import_hf(hf_dir)
        model.to(device).eval()
        ct2_dirs = {}
        for ct in ("float32", "int8"):
            ct2_dirs[ct] = work / f"ct2-{size}"
            if not (ct2_dirs[ct] / "model.bin").is_file():
                export_ctranslate2(model, config, vocab, ct2_dirs[ct])
        from transformers import MarianMTModel, MarianTokenizer

        hf = MarianMTModel.from_pretrained(hf_dir).eval()
        tok = MarianTokenizer.from_pretrained(hf_dir)
        for round_, search in [(r, s) for r in range(args.rounds) for s in args.searches]:
            beam = 1 if search == "greedy" else int(search.removeprefix("beam"))
            rows: dict[str, dict] = {}
            ref_tokens = None

            def record(name, seconds, tokens_lists=None, cpu_seconds=None, **extra):
                row = {"model": size, "search": search, "system": name, "round": round_,
                       "sent_per_s": len(lines) / seconds, "seconds": seconds, **extra}
                if cpu_seconds:
                    row["sent_per_cpu_s"] = len(lines) / cpu_seconds
                if tokens_lists is not None and ref_tokens is not None:
                    same = sum(a == b for a, b in zip(tokens_lists, ref_tokens))
                    row["identical_to_aiayn_fp32"] = same / len(lines)
                rows[name] = row
                print(f"  {size:>8} {search:>6} {name:<24} {row['sent_per_s']:8.1f} sent/s"
                      + (f" {row['sent_per_cpu_s']:8.1f} sent/CPU-s" if "sent_per_cpu_s" in row
                         else " " * 20)
                      + (f"  identical {row['identical_to_aiayn_fp32']:.1%}"
                         if "identical_to_aiayn_fp32" in row else "")
                      + (f"  row-steps {row['row_steps']}" if "row_steps" in row else ""),
                      flush=True)

            settings = dict(beam_size=beam, alpha=0.0, max_len_a=0.0, max_len_b=args.length,
                            batch_size=args.batch_size, beam_rules="hf")

            def warm_translator(precision):
                """A Translator at ``precision``, warmed up (and its int8 copy made) on 8
                lines, outside any timed region."""
                translator = Translator(model, vocab, config=config, device=device,
                                        precision=precision)
                translator.generate(lines[:8], preprocessed=True, min_len=args.length, **settings)
                return translator

            def run_aiayn(precision, workers=1):
                """aiayn's product surface, as `aiayn translate` runs it: a Translator at
                ``precision``; with ``workers`` > 1, that many forked one-thread processes
                over the one model (``aiayn translate``'s ``--workers``,
                :mod:`aiayn.decoding.workers`)."""
                translator = warm_translator(precision)
                best, best_cpu, out, stats = float("inf"), float("inf"), None, None
                for _ in range(args.repeat):
                    cuda_sync()
                    t, c = time.perf_counter(), time.process_time()
                    stats = DecodeStats()
                    out = translator.generate(lines, preprocessed=True, min_len=args.length,
                                              stats=stats, workers=workers, **settings)
                    cuda_sync()
                    best = min(best, time.perf_counter() - t)
                    best_cpu = min(best_cpu, time.process_time() - c)
                assert all(len(r[0].tokens) == args.length + 1 for r in out), "lengths not fixed"
                if workers > 1:  # the workers' CPU time is not this process's
                    best_cpu = None
                return best, [[vocab.output_pieces[i] for i in r[0].tokens[:-1]] for r in out], \
                    translator.precision, stats, best_cpu

            def run_aiayn_pool(workers):
                """aiayn's default in ``workers`` one-thread processes forked once, before the
                timed region (``aiayn.decoding.workers.WorkerPool``, as ``aiayn serve`` keeps
                them), each taking the next batch as it frees up: like CTranslate2's
                ``inter_threads`` translators, which are made before the timed region too."""
                from concurrent.futures import ThreadPoolExecutor

                from aiayn.decoding.workers import WorkerPool

                translator = warm_translator("auto")  # before the fork
                batches = [lines[i:i + args.batch_size]
                           for i in range(0, len(lines), args.batch_size)]

                def decode(batch):
                    return [r[0].tokens for r in translator.generate(
                        batch, preprocessed=True, min_len=args.length, **settings)]

                best, out = float("inf"), None
                with WorkerPool(decode, workers) as pool, \
                        ThreadPoolExecutor(workers) as threads:
                    list(threads.map(pool.run, batches[:workers]))  # each child's first batch
                    for _ in range(args.repeat):
                        t = time.perf_counter()
                        out = [tokens for done in threads.map(pool.run, batches)
                               for tokens in done]
                        best = min(best, time.perf_counter() - t)
                assert all(len(tokens) == args.length + 1 for tokens in out), "lengths not fixed"
                return best, [[vocab.output_pieces[i] for i in tokens[:-1]] for tokens in out], \
                    translator.precision

            seconds, ref_tokens, _, stats, cpu = run_aiayn("fp32")
            record("aiayn fp32", seconds, ref_tokens, cpu, row_steps=stats.row_steps)
            for precision in ("bf16", "int8"):
                if f"aiayn-{precision}" not in args.skip and not (on_gpu and precision == "int8"):
                    seconds, toks, _, stats, cpu = run_aiayn(precision)
                    record(f"aiayn {precision}", seconds, toks, cpu, row_steps=stats.row_steps)
            if "aiayn-default" not in args.skip:
                seconds, toks, chosen, stats, cpu = run_aiayn("auto")
                record("aiayn default", seconds, toks, cpu, precision=chosen.chosen,
                       precision_reason=chosen.reason, row_steps=stats.row_steps)
                if args.threads >= 2 and not on_gpu and "aiayn-workers" not in args.skip:
                    seconds, toks, chosen, stats, cpu = run_aiayn("auto", workers=args.threads)
                    record(f"aiayn default {args.threads}x1", seconds, toks,
                           precision=chosen.chosen, row_steps=stats.row_steps)
                    seconds, toks, chosen = run_aiayn_pool(args.threads)
                    record(f"aiayn default {args.threads}x1 pool", seconds, toks,
                           precision=chosen.chosen)
            for dtype in ("fp32", "bf16"):
                if f"hf-{dtype}" in args.skip:
                    continue
                net = hf if dtype == "fp32" else MarianMTModel.from_pretrained(
                    hf_dir, dtype=torch.bfloat16).eval()
                net.to(device)
                batches = [tok(lines[i:i + args.batch_size], return_tensors="pt", padding=True)
                           .to(device) for i in range(0, len(lines), args.batch_size)]
                gen = dict(num_beams=beam, do_sample=False, min_new_tokens=args.length,
                           max_new_tokens=args.length + 1, length_penalty=0.0,
                           bad_words_ids=[[hf.config.pad_token_id]])
                with torch.inference_mode():
                    net.generate(**batches[-1], **gen)  # warm-up
                    best, outs = float("inf"), []
                    for _ in range(args.repeat):
                        cuda_sync()
                        t = time.perf_counter()
                        outs = [net.generate(**b, **gen) for b in batches]
                        cuda_sync()
                        best = min(best, time.perf_counter() - t)
                toks = [[tok.decoder[i] for i in row[1:-1]] for o in outs for row in o.tolist()]
                record(f"hf {dtype}", best, toks)
            # CTranslate2 at intra_threads = T, and for int8 also at inter_threads = T (T
            # one-thread translators), the better of which is its best setting on T cores
            layouts = [("float32", 1), ("int8", 1)]
            if args.threads >= 2 and not on_gpu:
                layouts.append(("int8", args.threads))
            for ct, inter in layouts:
                for isa in isas:
                    name = (f"ct2 {'fp32' if ct == 'float32' else ct} {isa or 'default'}"
                            + (f" {inter}x1" if inter > 1 else ""))
                    if f"ct2-{isa or 'default'}" in args.skip:
                        continue
                    env = {**os.environ, "CT2_VERBOSE": "1"}  # it logs the ISA it chose
                    env.pop("CT2_FORCE_CPU_ISA", None)
                    if isa:
                        env["CT2_FORCE_CPU_ISA"] = isa
                    cmd = [sys.executable, __file__, "--ct2-worker", "--ct2-model",
                           str(ct2_dirs[ct]), "--pieces", str(pieces_file), "--compute-type",
                           ct, "--beam", str(beam), "--threads", str(args.threads),
                           "--length", str(args.length), "--batch-size", str(args.batch_size),
                           "--repeat", str(args.repeat), "--device", device.type,
                           "--inter-threads", str(inter)]
                    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                    if proc.returncode != 0:  # e.g. its CUDA build wants another CUDA's cuBLAS
                        why = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
                        print(f"  {size:>8} {search:>6} {name:<24} not run: CTranslate2 "
                              f"exited {proc.returncode}: {why}", flush=True)
                        skipped.append({"model": size, "search": search, "system": name,
                                        "error": why})
                        continue
                    res = json.loads(proc.stdout)
                    used = re.search(r"Selected ISA: (\S+)", proc.stderr)
                    gemm = re.search(r"GEMM_S8 backend: (\S+)", proc.stderr)
                    record(name, res["seconds"], [t[:-1] for t in res["tokens"]],
                           res["cpu_seconds"] if inter == 1 else None,
                           lengths=res["lengths"], ct2_isa=used.group(1) if used else None,
                           ct2_int8_gemm=gemm.group(1) if gemm else None)
            # the peer to beat: CTranslate2 int8 at its best ISA and thread layout, in this run
            ct2_int8 = [r for name, r in rows.items() if name.startswith("ct2 int8")]
            ref = max(ct2_int8, key=lambda r: r["sent_per_s"]) if ct2_int8 else None
            ref_cpu = max((r for r in ct2_int8 if "sent_per_cpu_s" in r),
                          key=lambda r: r["sent_per_cpu_s"], default=None)
            for row in rows.values():
                if ref:
                    row["x_ct2_int8_best"] = row["sent_per_s"] / ref["sent_per_s"]
                if ref_cpu and "sent_per_cpu_s" in row:
                    row["x_ct2_int8_best_cpu"] = row["sent_per_cpu_s"] / ref_cpu["sent_per_cpu_s"]
            results.extend(rows.values())
            if ref:
                print(f"    CTranslate2 int8 used ISA {ref.get('ct2_isa')} (int8 products: "
                      f"{ref.get('ct2_int8_gemm')}) on the {info['cpu_class']}", flush=True)
                print(f"    ratio to {ref['system']} (CTranslate2 int8 at its best ISA and thread "
                      "layout here), wall time: "
                      + ", ".join(f"{r['system']} {r['x_ct2_int8_best']:.2f}"
                                  for r in rows.values()), flush=True)
            if ref_cpu:
                print(f"    ratio to {ref_cpu['system']} per CPU second (the fair figure on a "
                      "shared machine, one process): "
                      + ", ".join(f"{r['system']} {r['x_ct2_int8_best_cpu']:.2f}"
                                  for r in rows.values() if "x_ct2_int8_best_cpu" in r),
                      flush=True)
    if args.rounds > 1:
        _print_medians(results)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({**info, "results": results,
                                                   "not_run": skipped}, indent=1),
                                       encoding="utf-8")
    # on a GPU the peer may lack its CUDA libraries (said above); on a CPU it must run
    return 1 if skipped and not on_gpu else 0


if __name__ == "__main__":
    raise SystemExit(main())
