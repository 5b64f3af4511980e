"""Documents against one sentence a line (issue 82): the first N source sentences of a test set
joined into paragraphs of 3-8 sentences (a fixed seed), translated with ``--document``
(:meth:`aiayn.Translator.translate_document`) and one a line (:meth:`generate`).

It reports whether the translated document has the same paragraphs and one translation per
sentence the splitter found; the share of source sentences whose boundaries the splitter
found exactly (sentencex, :mod:`aiayn.data.segment`); the share of sentences translated the
same, byte for byte, both ways; and sacreBLEU against the references joined into the same
paragraphs (one paragraph a segment, since a missed or extra boundary leaves sentences
unaligned), both ways, and sentence-level BLEU of the line-by-line output.

Run:  python bench/bench_document.py --checkpoint RUN --src newstest2014.en \\
          --ref newstest2014.de [--sentences 300] [--beam 4] [--json]

No timing is taken: the figures are counts and BLEU, the same on any machine class.
"""

from __future__ import annotations

import argparse
import json
import random


def paragraphs_of(n: int, seed: int = 0, low: int = 3, high: int = 8) -> list[int]:
    """Paragraph sizes in [low, high] covering n sentences (the last may be shorter)."""
    rng, sizes = random.Random(seed), []
    while sum(sizes) < n:
        sizes.append(min(rng.randint(low, high), n - sum(sizes)))
    return sizes


def group(lines: list[str], sizes: list[int]) -> list[str]:
    out, i = [], 0
    for k in sizes:
        out.append(" ".join(lines[i:i + k]))
        i += k
    return out


def main() -> None:

    from aiayn import Translator
    from aiayn.data.segment import segment
    from aiayn.evaluation.bleu import read_lines, sacrebleu_scores

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--src", required=True)
    p.add_argument("--ref", required=True)
    p.add_argument("--sentences", type=int, default=300)
    p.add_argument("--beam", type=int, default=None)
    p.add_argument("--lang", default="en")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    src = [s.strip() for s in read_lines(args.src)[:args.sentences]]
    ref = [s.strip() for s in read_lines(args.ref)[:args.sentences]]
    sizes = paragraphs_of(len(src))
    text = "\n\n".join(group(src, sizes)) + "\n"
    translator = Translator.from_pretrained(args.checkpoint)

    doc = segment(text, args.lang)
    pos, spans = 0, []  # each source sentence's (start, end) in the document
    for s in src:
        a = text.index(s, pos)
        spans.append((a, a + len(s)))
        pos = a + len(s)
    found = set(doc.spans)
    exact = [sp in found for sp in spans]

    lines = translator.generate(src, beam_size=args.beam)
    by_line = [ts[0].text for ts in lines]
    result = translator.translate_document(text, lang=args.lang, beam_size=args.beam)
    out_paras = result.text.rstrip("\n").split("\n\n")
    per_para = [doc.paragraphs.count(n) for n in range(len(sizes))]
    # the same paragraphs: as many, each non-empty, the gaps kept ("\n\n" and a final "\n")
    same_layout = (len(out_paras) == len(sizes) and result.text.endswith("\n")
                   and all(pp.strip() for pp in out_paras) and result.document.gaps.count(
                       "\n\n") == len(sizes) - 1)
    doc_of = dict(zip(doc.spans, result.translations))
    identical = sum(doc_of.get(sp) == t for sp, t in zip(spans, by_line))

    ref_paras = group(ref, sizes)
    bleu_doc = sacrebleu_scores(out_paras, ref_paras)
    bleu_lines = sacrebleu_scores(group(by_line, sizes), ref_paras)
    bleu_sent = sacrebleu_scores(by_line, ref)
    report = {
        "sentences": len(src), "paragraphs": len(sizes),
        "segments_found": len(doc.spans),
        "boundaries_exact_share": round(sum(exact) / len(src), 4),
        "same_paragraphs": same_layout,
        "segments_per_paragraph": per_para,
        "one_translation_per_segment": len(result.translations) == len(doc.spans),
        "identical_translation_share": round(identical / len(src), 4),
        "bleu_paragraphs_document": round(bleu_doc["bleu"], 2),
        "bleu_paragraphs_lines": round(bleu_lines["bleu"], 2),
        "bleu_sentences_lines": round(bleu_sent["bleu"], 2),
        "signature": bleu_doc["bleu_signature"],
        "checkpoint": args.checkpoint, "beam": args.beam or translator.decode_config.beam_size,
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for k, v in report.items():
            print(f"{k:45s} {v}")


if __name__ == "__main__":
    main()
