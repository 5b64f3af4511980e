"""Markup carried through translation (issue 83, item 3): source sentences of a test set with
tags inserted around random source spans (a fixed seed), translated with ``markup=True``
(:mod:`aiayn.decoding.markup`) and without markup.

Each sentence gets three tags: a ``<b>`` pair around 1-4 random words, an ``<i class="x">`` pair
nested inside it or beside it (even odds; nested when there is no room beside), and a
self-closing ``<x id="N"/>`` at a random word boundary. A pair ending on a word with trailing
punctuation closes before it (``<b>the street</b>.``), as web text does.

It reports the share of outputs with every tag present and well-formed (the standard library's
XML parser, the tags compared as a multiset), the share of items the word alignments placed
(the rest by a fallback), and sacreBLEU of the tag-stripped output against the translation of
the untagged sentence (and, for scale, both against the references). With ``--naive``, the
same for the tagged sentences fed to the model as they are (no markup handling), a baseline.

Run:  python bench/bench_markup.py --checkpoint RUN [--src test_2016_flickr.en.gz]
          [--ref test_2016_flickr.de.gz] [--sentences 1000] [--seed 0] [--placeholders]
          [--naive] [--json]

No timing is taken: the figures are counts and BLEU, the same on any machine class.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from pathlib import Path

_TRAILING_PUNCT = re.compile(r"(.*?\w)([^\w\s]+)")
_ANY_TAG = re.compile(r"<[^<>]*>")


def tag_line(line: str, rng: random.Random, number: int) -> str:
    """``line`` with a ``<b>`` pair, an ``<i class="x">`` pair and an ``<x id=.../>`` tag."""
    words = line.split()
    n = len(words)
    if n == 0:
        return line
    opens: list[list[str]] = [[] for _ in range(n)]
    closes: list[list[str]] = [[] for _ in range(n)]
    points: list[list[str]] = [[] for _ in range(n + 1)]

    def pair(a: int, b: int, name: str, attrs: str = "") -> None:  # words [a, b), inner last
        opens[a].append(f"<{name}{attrs}>")
        closes[b - 1].insert(0, f"</{name}>")

    k = rng.randint(1, min(4, n))
    a = rng.randint(0, n - k)
    pair(a, a + k, "b")
    room = [(s, e) for s, e in ((0, a), (a + k, n)) if e > s]
    if rng.random() < 0.5 or not room:
        s, e = a, a + k
    else:
        s, e = rng.choice(room)
    k2 = rng.randint(1, e - s)
    a2 = rng.randint(s, e - k2)
    pair(a2, a2 + k2, "i", ' class="x"')
    points[rng.randint(0, n)].append(f'<x id="{number}"/>')
    out = []
    for i in range(n + 1):
        out += points[i]
        if i < n:
            word, tail = words[i], ""
            split = _TRAILING_PUNCT.fullmatch(word) if closes[i] else None
            if split:
                word, tail = split.groups()
            out.append("".join(opens[i]) + word + "".join(closes[i]) + tail)
    return " ".join(out)


def strip_tags(text: str) -> str:
    """``text`` without its tags, one space between words."""
    return " ".join(_ANY_TAG.sub("", text).split())


def complete(source: str, output: str) -> bool:
    """Every tag of ``source`` in ``output`` once, and ``output`` well-formed."""
    from aiayn.decoding.markup import tags_of, well_formed

    return well_formed(output) and sorted(tags_of(output)) == sorted(tags_of(source))


def main() -> None:

    from aiayn import Translator
    from aiayn.decoding.markup import MarkupConfig, copyable, parse, restore
    from aiayn.evaluation.bleu import read_lines, sacrebleu_scores

    data = Path(os.environ.get("AIAYN_DATA_DIR", "data")) / "multi30k"
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--src", default=str(data / "test_2016_flickr.en.gz"))
    p.add_argument("--ref", default=str(data / "test_2016_flickr.de.gz"))
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--beam", type=int, default=None)
    p.add_argument("--placeholders", action="store_true",
                   help="the default placeholders too (numbers, URLs, ...), not tags only")
    p.add_argument("--only-placeholders", action="store_true",
                   help="only the sentences holding a default placeholder (with "
                        "--placeholders): how many come back exactly")
    p.add_argument("--naive", action="store_true",
                   help="also feed the tagged sentences to the model as they are (a baseline)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    src = [s.strip() for s in read_lines(args.src)[:args.sentences]]
    ref = [s.strip() for s in read_lines(args.ref)[:args.sentences]]
    if args.only_placeholders:
        keep = [n for n, line in enumerate(src) if parse(line).items]
        src, ref = [src[n] for n in keep], [ref[n] for n in keep]
    rng = random.Random(args.seed)
    tagged = [tag_line(s, rng, n) for n, s in enumerate(src)]
    config = MarkupConfig() if args.placeholders else MarkupConfig(placeholders=())
    translator = Translator.from_pretrained(args.checkpoint)
    options = dict(beam_size=args.beam, workers=1)

    marked = translator.generate(tagged, markup=config, **options)  # the face
    marked_out = [ts[0].text for ts in marked]
    plain_out = translator.translate(src, **options)
    naive_out = translator.translate(tagged, **options) if args.naive else None

    # where the items went: the same parse and restore over the plain translation that each
    # alignment holds (its target words)
    aligned = fallback = same_text = 0
    keep = copyable(translator) if args.placeholders else False  # as the face does
    for line, s, ts in zip(tagged, src, marked):
        m = parse(line, config, keep_copies=keep)
        a = ts[0].alignment
        r = restore(m, " ".join(a.target_words) if a is not None else "", a)
        aligned, fallback = aligned + r.aligned, fallback + r.fallback
        same_text += m.plain == s


    def bleu(hyps: list[str], refs: list[str]) -> float:
        return round(sacrebleu_scores(hyps, refs)["bleu"], 2)

    tags = sum(len(re.findall(r"<[a-z]", t)) for t in tagged)
    pairs = sum(t.count("</") for t in tagged)
    report = {
        "sentences": len(src), "tags": tags, "paired": pairs, "self_closing": tags - pairs,
        "placeholders": args.placeholders, "plain_equals_untagged_share": round(
            same_text / len(src), 4),
        "markup_complete_well_formed_share": round(
            sum(map(complete, tagged, marked_out)) / len(src), 4),
        "markup_items_aligned_share": round(aligned / max(1, aligned + fallback), 4),
        "placeholders_exact_share": round(sum(
            all(out.count(p) >= src_line.count(p) for p in found)
            for src_line, out, found in ((s, o, [it.text for it in parse(s, config).items
                                                 if it.kind == "placeholder"])
                                         for s, o in zip(src, marked_out))) / len(src), 4),
        "markup_bleu_stripped_vs_untagged": bleu([strip_tags(t) for t in marked_out], plain_out),
        "markup_identical_stripped_share": round(sum(
            strip_tags(t) == " ".join(u.split()) for t, u in zip(marked_out, plain_out))
            / len(src), 4),
        **({} if naive_out is None else {
            "naive_complete_well_formed_share": round(
                sum(map(complete, tagged, naive_out)) / len(src), 4),
            "naive_bleu_stripped_vs_untagged": bleu([strip_tags(t) for t in naive_out], plain_out),
            "bleu_naive_stripped_vs_ref": bleu([strip_tags(t) for t in naive_out], ref)}),
        "bleu_untagged_vs_ref": bleu(plain_out, ref),
        "bleu_markup_stripped_vs_ref": bleu([strip_tags(t) for t in marked_out], ref),
        "signature": sacrebleu_scores(plain_out, ref)["bleu_signature"],
        "checkpoint": args.checkpoint, "beam": args.beam or translator.decode_config.beam_size,
        "seed": args.seed, "example": [tagged[0], marked_out[0]],
        "stripped_differs": [[t, o, u] for t, o, u in zip(tagged, marked_out, plain_out)
                             if strip_tags(o) != " ".join(u.split())][:5],
    }
    if args.json:
        print(json.dumps(report, indent=1, ensure_ascii=False))
    else:
        for k, v in report.items():
            print(f"{k:40s} {v}")


if __name__ == "__main__":
    main()
