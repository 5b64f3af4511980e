"""The n-gram guard on a test set (issue 82, docs/benchmarks.md#guards-on-test2016): the
sentences translated without the guards and with ``no_repeat_ngram_size=N``; for each, the
outputs holding a repeated N-gram (of the model's subword tokens, what the guard rules out,
and of whitespace-separated words), the lines the guard changed, and sacreBLEU (cased,
detokenized text; its signature is printed).

Run:  python bench/bench_guards.py --checkpoint RUN --src test_2016_flickr.en.gz \\
          --ref test_2016_flickr.de.gz [--ngram 4] [--beam K] [--out DIR] [--json]

``--out DIR`` writes each output there (``off.txt``, ``ngram-N.txt``), one line per sentence,
for ``cmp`` against another build's ``aiayn translate``. No timing is taken: the figures are
counts and BLEU, the same on any machine of one CPU class.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    from aiayn import Translator
    from aiayn.decoding.guards import has_repeated_ngram
    from aiayn.evaluation.bleu import read_lines, sacrebleu_scores
    from aiayn.fileio import atomic_file

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--src", required=True)
    p.add_argument("--ref", required=True)
    p.add_argument("--ngram", type=int, default=4)
    p.add_argument("--beam", type=int, default=None)
    p.add_argument("--out", default=None, metavar="DIR")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    src, ref = read_lines(args.src), read_lines(args.ref)
    translator = Translator.from_pretrained(args.checkpoint, workers="auto")
    n = args.ngram
    runs, first = {}, None
    for name, extra in (("off", {}), (f"ngram-{n}", {"no_repeat_ngram_size": n})):
        out = [r[0] for r in translator.generate(src, beam_size=args.beam, **extra)]
        texts = [t.text for t in out]
        scores = sacrebleu_scores(texts, ref)
        runs[name] = {
            "repeated_subword_ngram": sum(has_repeated_ngram(t.tokens, n) for t in out),
            "repeated_word_ngram": sum(has_repeated_ngram(t.split(), n) for t in texts),
            "changed_lines": 0 if first is None else sum(a != b for a, b in zip(first, texts)),
            "bleu": round(scores["bleu"], 2), "chrf": round(scores["chrf"], 2),
            "bleu_signature": scores["bleu_signature"]}
        first = texts if first is None else first
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            with atomic_file(Path(args.out) / f"{name}.txt", "w") as f:
                f.writelines(t.replace("\n", " ") + "\n" for t in texts)
    result = {"checkpoint": args.checkpoint, "sentences": len(src), "ngram": n,
              "precision": translator.precision.chosen,
              "decode": str(translator.decode_settings(beam_size=args.beam)), "runs": runs}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{len(src)} sentences, {result['decode']}, {result['precision']}")
    for name, r in runs.items():
        print(f"{name:>10}: outputs with a repeated {n}-gram: {r['repeated_subword_ngram']} "
              f"(subwords), {r['repeated_word_ngram']} (words); lines changed "
              f"{r['changed_lines']}; BLEU {r['bleu']}, chrF {r['chrf']}")
    print(runs["off"]["bleu_signature"])


if __name__ == "__main__":
    main()
