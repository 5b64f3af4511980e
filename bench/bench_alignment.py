"""Word alignments from cross-attention (issue 83): alignment error rate against a gold
standard of copied tokens, per decoder layer, and BLEU, for one or more models (a model
trained without and one with guided alignment, ``train.guided_alignment_weight``).

Gold standard (built here, from the text alone): a sure link (i, j) wherever source word i and
target word j are the same token (case-insensitive, surrounding punctuation stripped) that
occurs exactly once on each side and is a number (holds a digit), a name (capitalized on both
sides and not the first word of either) or at least 4 characters long (an identical word:
"Jeans", "Frisbee", "Hotdog"). A copied token must align to its copy. Every link is sure
(no possible links), so AER = 1 - 2|A ∩ S| / (|A| + |S|) with A the model's links restricted to
the target words the gold standard covers; with one link per target word that is 1 - the share
of gold target words linked to their copy.

Two pairs per sentence: (source, reference), the reference forced through the model (the
usual AER setting), and (source, the model's own output), the alignments ``aiayn translate
--alignments`` writes. BLEU: sacreBLEU cased on detokenized output (13a), beam search with each
model's own decode settings.

Run:  python bench/bench_alignment.py --model RUN [--model RUN2 ...] [--sentences N]
          [--news-sentences N] [--json]

No timing is taken: the figures are counts, AER and BLEU, the same on any machine class.
"""

from __future__ import annotations

import argparse
import json
import os
import string
from pathlib import Path

PUNCT = string.punctuation + "„“”‚‘’«»–—…"


def _norm(word: str) -> str:
    return word.strip(PUNCT).lower()


def gold_links(source: str, target: str) -> set[tuple[int, int]]:
    """The sure links of one pair (see the module docstring)."""
    src, tgt = source.split(), target.split()
    keys_s, keys_t = [_norm(w) for w in src], [_norm(w) for w in tgt]
    links = set()
    for j, key in enumerate(keys_t):
        if not key or keys_t.count(key) != 1 or keys_s.count(key) != 1:
            continue
        i = keys_s.index(key)
        number = any(c.isdigit() for c in key)
        name = (src[i].strip(PUNCT)[:1].isupper() and tgt[j].strip(PUNCT)[:1].isupper()
                and i > 0 and j > 0)
        if number or name or len(key) >= 4:
            links.add((i, j))
    return links


def aer(found: list, gold: list[set]) -> tuple[float, int]:
    """AER over the gold target words (sure links only), and the gold standard's size."""
    hit = size = predicted = 0
    for alignment, sure in zip(found, gold):
        targets = {j for _, j in sure}
        links = {(i, j) for i, j in alignment.pairs if j in targets}
        hit += len(links & sure)
        size += len(sure)
        predicted += len(links)
    return (1.0 - 2 * hit / (predicted + size) if size else float("nan")), size


def main() -> None:
    from aiayn.evaluation.bleu import sacrebleu_scores

    from aiayn import Translator
    from aiayn.decoding.alignment import alignment_head
    from aiayn.evaluation.bleu import read_lines

    data = Path(os.environ.get("AIAYN_DATA_DIR", "data"))
    sets = {"test2016": (data / "multi30k/test_2016_flickr.en.gz",
                         data / "multi30k/test_2016_flickr.de.gz"),
            "newstest2014": (data / "wmt14-en-de/newstest2014.en",
                             data / "wmt14-en-de/newstest2014.de")}
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", required=True, help="a run or checkpoint")
    p.add_argument("--sentences", type=int, default=0, help="the first N of each set (0: all)")
    p.add_argument("--news-sentences", type=int, default=0,
                   help="the first N of newstest2014 (0: as --sentences)")
    p.add_argument("--sets", nargs="+", default=list(sets), choices=list(sets))
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    rows = []
    for path in args.model:
        tr = Translator.from_pretrained(path, device="cpu", precision="fp32", workers=1)
        N = tr.config.model.N
        for name in args.sets:
            src_path, ref_path = sets[name]
            src = [s.strip() for s in read_lines(src_path)]
            ref = [s.strip() for s in read_lines(ref_path)]
            limit = args.news_sentences if name == "newstest2014" and args.news_sentences \
                else args.sentences
            if limit:
                src, ref = src[:limit], ref[:limit]
            out = tr.generate(src, long_inputs="split", alignments=True)
            hyps = [ts[0].text for ts in out]
            bleu = sacrebleu_scores(hyps, ref)
            gold_ref = [gold_links(s, r) for s, r in zip(src, ref)]
            gold_hyp = [gold_links(s, h) for s, h in zip(src, hyps)]
            keep = [n for n, s in enumerate(src)
                    if len(tr.vocab.encode(s)) < tr.max_source_tokens
                    and len(tr.vocab.encode(ref[n])) < tr.max_source_tokens]
            row = {"model": path, "set": name, "sentences": len(src),
                   "bleu": round(bleu["bleu"], 2), "bleu_signature": bleu["bleu_signature"],
                   "default_layer": list(alignment_head(tr.config))}
            # the output's own alignments (default layer), as `aiayn translate` writes them
            row["aer_output"], row["gold_output"] = aer([ts[0].alignment for ts in out],
                                                        gold_hyp)
            for layer in [None, *range(N)]:
                forced = tr.align([src[n] for n in keep], [ref[n] for n in keep], layer=layer)
                value, size = aer(forced, [gold_ref[n] for n in keep])
                key = "default" if layer is None else f"layer{layer}"
                row[f"aer_reference_{key}"], row["gold_reference"] = round(value, 4), size
                if layer is not None:
                    again = tr.with_alignments(src, src, out, layer=layer)
                    row[f"aer_output_{key}"] = round(aer([ts[0].alignment for ts in again],
                                                         gold_hyp)[0], 4)
            row["aer_output"] = round(row["aer_output"], 4)
            rows.append(row)
            if not args.json:
                print(json.dumps(row, ensure_ascii=False), flush=True)
    if args.json:
        print(json.dumps(rows, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
