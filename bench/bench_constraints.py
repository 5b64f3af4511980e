"""Terminology constraints by dynamic beam allocation (issue 83): placed share, BLEU and speed
against unconstrained decoding, on Multi30k test2016 en->de with constraints from the references.

Run:  AIAYN_DATA_DIR=../shared/data python bench/bench_constraints.py --checkpoint RUN
      [--sentences 1000] [--rounds 2] [--base-sentences 64] [--json-out FILE]

Constraints are taken from each reference as Post & Vilar (2018) and Hu et al. (2019) do: for
``--per-sentence`` k (1 and 3), k non-overlapping phrases of 1-3 words drawn at random from the
raw cased reference (words holding punctuation left out; ``random.Random(--seed)``, seed 1 by
default). A sentence whose reference has too few such words gets as many phrases as fit.

For the trained model (``--checkpoint``, at its run's decoding precision unless
``--precision``), beam 4, one thread, one process: the share of constraints placed (every phrase
found in the output's tokens, :func:`aiayn.decoding.constraints.placed`), sacreBLEU (cased,
detokenized, 13a: its signature is printed) against the references, and sentences/s and
sentences per CPU second. The unconstrained and constrained runs are interleaved, ``--rounds``
times each, and the fastest round of each is kept: the machine may be shared.

With ``--base-sentences N`` > 0, the same timing on the paper's base shape (N=6, d_model 512,
h 8, d_ff 2048) with random weights over the checkpoint's vocabulary, fp32, beam 4: every
output forced to exactly 25 tokens plus EOS (``min_len``), so the two runs do the same number
of decoder steps and the ratio is the constrained search's own cost.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import sys
import time
from pathlib import Path

WORD = re.compile(r"^\w+$")


def _read(path: Path, limit: int | None = None) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = [line.strip() for line in f]
    return lines[:limit] if limit else lines


def reference_phrases(ref: str, k: int, rng: random.Random) -> list[str]:
    """``k`` non-overlapping phrases of 1-3 words of ``ref`` (words without punctuation)."""
    words = ref.split()
    ok = [bool(WORD.match(w)) for w in words]
    taken = [False] * len(words)
    phrases = []
    for _ in range(k):
        spans = [(i, n) for n in (1, 2, 3) for i in range(len(words) - n + 1)
                 if all(ok[i:i + n]) and not any(taken[i:i + n])]
        if not spans:
            break
        n = rng.choice([n for n in (1, 2, 3) if any(m == n for _, m in spans)])
        i, n = rng.choice([s for s in spans if s[1] == n])
        taken[i:i + n] = [True] * n
        phrases.append(" ".join(words[i:i + n]))
    return phrases


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def cpu_class() -> str:
    import torch

    info = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        family = re.search(r"cpu family\s*:\s*(\d+)", text)
        model = re.search(r"model\s*:\s*(\d+)", text)
        name = re.search(r"model name\s*:\s*(.+)", text)
        info = (f"{name.group(1).strip()}, family {family.group(1)} model {model.group(1)}"
                if name and family and model else "")
    except OSError:
        pass
    cls = "bf16 class" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "AVX2 class"
    return f"{cls} ({info})" if info else cls


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--precision", default=None)
    p.add_argument("--sentences", type=int, default=0, help="0: all of test2016")
    p.add_argument("--per-sentence", type=int, nargs="+", default=[1, 3])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--base-sentences", type=int, default=0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)
    from aiayn import Translator
    from aiayn.decoding.constraints import placed
    from aiayn.evaluation.bleu import sacrebleu_scores

    data = Path(os.environ.get("AIAYN_DATA_DIR", "data")) / "multi30k"
    src = _read(data / "test_2016_flickr.en.gz", args.sentences or None)
    ref = _read(data / "test_2016_flickr.de.gz", args.sentences or None)
    translator = Translator.from_pretrained(args.checkpoint, device="cpu",
                                            precision=args.precision, workers=1)
    opts = dict(beam_size=args.beam, batch_size=args.batch_size, workers=1)
    sets = {0: None}
    for k in args.per_sentence:
        rng = random.Random(args.seed)
        sets[k] = [reference_phrases(r, k, rng) or None for r in ref]
    translator.generate(src[:16], **opts)  # warm-up (kernels, int8 copies)
    rows = {}
    for _ in range(args.rounds):  # interleaved: the machine is shared
        for k, cons in sets.items():
            out, wall, cpu = timed(lambda: translator.generate(src, constraints=cons, **opts))
            best = rows.get(k)
            if best is None or wall < best["wall_s"]:
                rows[k] = {"wall_s": wall, "cpu_s": cpu, "out": out}
    report = {"cpu": cpu_class(), "checkpoint": args.checkpoint,
              "precision": translator.precision.chosen, "beam": args.beam,
              "sentences": len(src), "threads": 1, "seed": args.seed, "rows": []}
    for k, cons in sets.items():
        out = rows[k]["out"]
        hyps = [o[0].text for o in out]
        scores = sacrebleu_scores(hyps, ref)
        n_phr = n_placed = 0
        if cons is not None:
            ids = [None if c is None else [translator.vocab.encode(x) for x in
                                           translator.preprocess(c, "tgt")] for c in cons]
            for c, o in zip(ids, out):
                if c:
                    got = placed(c, o[0].tokens)
                    n_phr += len(got)
                    n_placed += sum(got)
        report["rows"].append({
            "constraints_per_sentence": k, "phrases": n_phr, "placed": n_placed,
            "bleu": round(scores["bleu"], 2), "signature": scores["bleu_signature"],
            "sent_per_s": round(len(src) / rows[k]["wall_s"], 1),
            "sent_per_cpu_s": round(len(src) / rows[k]["cpu_s"], 1)})
    if args.base_sentences:
        report["base"] = base_shape(translator, src[:args.base_sentences], sets, args)
    print(json.dumps(report, indent=1, ensure_ascii=False))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1, ensure_ascii=False))
    return 0


def base_shape(translator, src, sets, args) -> list[dict]:
    """Speed alone on the base shape (random weights, outputs forced to 25 tokens)."""
    import dataclasses

    import torch

    from aiayn import Translator
    from aiayn.model import Transformer

    cfg = dataclasses.replace(translator.config.model, N=6, d_model=512, h=8, d_k=64, d_v=64,
                              d_ff=2048)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    base = Translator(model, translator.vocab, config=dataclasses.replace(
        translator.config, model=cfg), precision="fp32", workers=1)
    opts = dict(beam_size=args.beam, batch_size=args.batch_size, workers=1, max_len_a=0.0,
                max_len_b=25, min_len=25)
    base.generate(src[:8], **opts)
    best: dict[int, float] = {}
    cpu: dict[int, float] = {}
    for _ in range(args.rounds):
        for k, cons in sets.items():
            c = None if cons is None else cons[:len(src)]
            _, wall, used = timed(lambda: base.generate(src, constraints=c, **opts))
            if k not in best or wall < best[k]:
                best[k], cpu[k] = wall, used
    return [{"constraints_per_sentence": k, "sent_per_s": round(len(src) / best[k], 2),
             "sent_per_cpu_s": round(len(src) / cpu[k], 2),
             "ratio_to_unconstrained": round(best[0] / best[k], 3)} for k in best]


if __name__ == "__main__":
    sys.exit(main())
