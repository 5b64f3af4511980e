"""Flags for likely failures, measured (issue 82, item 4): how many lines of Multi30k test2016
and of a set of known-bad inputs each flag (:mod:`aiayn.decoding.quality`) raises, and the
BLEU of test2016's flagged lines against its unflagged ones.

The known-bad set is made here from test2016's English sources (the first ``--bad`` lines):

- ``greek``, ``cyrillic``: the line transliterated letter by letter into another script;
- ``german``: the line's German reference given as the source (already the target language);
- ``doubled``: every word written twice ("A A man man ...");
- ``one word``: one word of the line repeated 30 times;
- ``very long``: 12 consecutive lines joined into one (longer than any training caption;
  split into parts where over the model's limit);
- ``numbers``: digit groups only;
- ``empty``: one empty line.

The length-ratio range is the model's recorded one (a pipeline's run directory), else made
here from Multi30k val's references as the pipeline makes it
(:func:`aiayn.decoding.quality.length_ratio_range`), and said which.

BLEU is sacreBLEU's corpus BLEU on detokenized cased text (its default 13a tokenization), the
signature printed; the model writes raw cased text, so its output is scored as it is.

Run:  python bench/bench_flags.py --checkpoint RUN [--bad 100] [--json OUT.json]

The figures are counts and BLEU, the same on any machine class (decoding is batch-invariant
in fp32); the one timing (what computing the flags costs against decoding) is perturbed by
whatever else runs on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from pathlib import Path

GREEK = dict(zip("abcdefghijklmnopqrstuvwxyz", "αβκδεφγηιξκλμνοπθρστυβωχυζ"))
CYRILLIC = dict(zip("abcdefghijklmnopqrstuvwxyz", "абцдефгхийклмнопкрстувшкыз"))


def transliterate(line: str, table: dict[str, str]) -> str:
    """``line`` letter by letter into another script (case kept)."""
    out = []
    for ch in line:
        low = ch.lower()
        if low in table:
            out.append(table[low].upper() if ch.isupper() else table[low])
        else:
            out.append(ch)
    return "".join(out)


def known_bad(src: list[str], ref: list[str], n: int) -> dict[str, list[str]]:
    """The known-bad inputs by kind, from the first ``n`` test lines (see the docstring)."""
    import random

    rng = random.Random(0)
    head = src[:n]
    return {
        "greek": [transliterate(s, GREEK) for s in head],
        "cyrillic": [transliterate(s, CYRILLIC) for s in head],
        "german": ref[:n],
        "doubled": [" ".join(w for word in s.split() for w in (word, word)) for s in head],
        "one word": [" ".join([max(s.split(), key=len).strip(".,")] * 30) for s in head],
        "very long": [" ".join(src[i:i + 12]) for i in range(0, 12 * max(1, n // 10), 12)],
        "numbers": [" ".join(str(rng.randint(1, 99999)) for _ in range(rng.randint(1, 8)))
                    for _ in head],
        "empty": [""],
    }


def share(counts: dict[str, int], total: int) -> dict[str, float]:
    return {k: round(100 * v / max(1, total), 1) for k, v in counts.items()}


def main() -> None:

    from aiayn import Translator
    from aiayn.decoding.quality import FLAGS, assess, flag_counts, length_ratio_range
    from aiayn.evaluation.bleu import read_lines

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", default=str(Path(os.environ.get("AIAYN_DATA_DIR", "data"))
                                         / "multi30k"))
    p.add_argument("--bad", type=int, default=100, help="test lines each bad kind is made of")
    p.add_argument("--workers", default="auto")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the figures here")
    args = p.parse_args()
    workers = args.workers if args.workers == "auto" else int(args.workers)

    data = Path(args.data)
    src = read_lines(str(data / "test_2016_flickr.en.gz"))
    ref = read_lines(str(data / "test_2016_flickr.de.gz"))
    translator = Translator.from_pretrained(args.checkpoint, workers=workers)
    if translator.length_range is not None:
        where = "recorded with the model (its generation record)"
    else:
        val_src = translator.preprocess(read_lines(str(data / "val.en.gz")))
        val_tgt = translator.preprocess(read_lines(str(data / "val.de.gz")), "tgt")
        translator.length_range = length_ratio_range(translator.vocab, val_src, val_tgt)
        where = "made here from Multi30k val's references (none recorded)"
    rng = translator.length_range
    print(f"length ratio range [{rng.low:.3f}, {rng.high:.3f}] over {rng.sentences} val pairs, "
          f"{where}")
    print(f"model: {translator!r}")

    t0 = time.perf_counter()
    test = [ts[0] for ts in translator.generate_text(src).translations]
    decode_s = time.perf_counter() - t0
    # the flags' cost: assess again over every output, alone (perturbed by the machine)
    src_tokens = [len(ids) for ids in translator.vocab.encode_batch(translator.preprocess(src))]
    t0 = time.perf_counter()
    for line, t, n in zip(src, test, src_tokens):
        assess(t.tokens, t.log_prob, t.text, line, n, 10**6, rng)
    assess_s = time.perf_counter() - t0

    from aiayn.evaluation.bleu import sacrebleu_scores

    def bleu_of(idx: list[int]) -> float | None:
        if not idx:
            return None
        return round(sacrebleu_scores([test[i].text for i in idx], [ref[i] for i in idx])
                     ["bleu"], 2)

    flagged = [i for i, t in enumerate(test) if t.flags]
    clean = [i for i, t in enumerate(test) if not t.flags]
    by_flag = {f: [i for i, t in enumerate(test) if f in t.flags] for f in FLAGS}
    order = sorted(range(len(test)), key=lambda i: test[i].confidence)
    tenth = len(order) // 10
    results = {
        "test2016": {
            "lines": len(test), "flagged_pct": share(flag_counts(test), len(test)),
            "bleu_all": bleu_of(list(range(len(test)))), "bleu_flagged": bleu_of(flagged),
            "bleu_unflagged": bleu_of(clean), "flagged_lines": len(flagged),
            "bleu_by_flag": {f: bleu_of(ix) for f, ix in by_flag.items()},
            "bleu_lowest_confidence_10pct": bleu_of(order[:tenth]),
            "bleu_other_90pct": bleu_of(order[tenth:]),
            "mean_confidence_flagged": round(sum(test[i].confidence for i in flagged)
                                             / max(1, len(flagged)), 3),
            "mean_confidence_unflagged": round(sum(test[i].confidence for i in clean)
                                               / max(1, len(clean)), 3),
        },
        "bleu_signature": sacrebleu_scores([t.text for t in test], ref)["bleu_signature"],
        "length_range": [round(rng.low, 4), round(rng.high, 4), where],
        "decode_s": round(decode_s, 1), "assess_s": round(assess_s, 4),
        "known_bad": {},
    }
    examples = {}
    bad_counts: Counter = Counter()
    bad_lines = 0
    for kind, lines in known_bad(src, ref, args.bad).items():
        out = [ts[0] for ts in translator.generate_text(lines).translations]
        counts = flag_counts(out)
        bad_counts.update(counts)
        bad_lines += len(out)
        results["known_bad"][kind] = {"lines": len(lines), "flagged_pct": share(counts, len(out))}
        examples[kind] = {"source": lines[0][:160], "output": out[0].text[:160],
                          "confidence": round(out[0].confidence, 3), "flags": list(out[0].flags)}
    results["known_bad"]["all known-bad"] = {"lines": bad_lines,
                                             "flagged_pct": share(bad_counts, bad_lines)}
    results["known_bad_examples"] = examples
    print(json.dumps(results, ensure_ascii=False, indent=1))
    print("\n| input | lines | " + " | ".join(f"`{f}`" for f in FLAGS) + " | any |")
    print("|---|---:|" + "---:|" * (len(FLAGS) + 1))
    rows = {"Multi30k test2016": results["test2016"], **results["known_bad"]}
    for name, row in rows.items():
        pct = row["flagged_pct"]
        print(f"| {name} | {row['lines']:,} | "
              + " | ".join(f"{pct[f]:.1f}%" for f in (*FLAGS, "any")) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, ensure_ascii=False, indent=1) + "\n",
                                   encoding="utf-8")


if __name__ == "__main__":
    main()
