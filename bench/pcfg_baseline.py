"""Score a treebank PCFG baseline for the parsing experiment (§6.3) with the parser's scorer.

Run:  nice -n 19 env OMP_NUM_THREADS=1 python bench/pcfg_baseline.py --data DIR \\
          --out FILE.jsonl [--max-words 40] [--limit K] [--min-rule-count 1] [--score-only]

The grammar is read off DIR/train.gold (written by `aiayn parse prepare --out DIR`) by
:mod:`aiayn.parsing.pcfg`: nltk's induce_pcfg over parent-annotated trees (Johnson 1998),
right-binarized with horizontal Markov order 1 (Klein & Manning 2003), unknown words mapped to
word classes; each sentence of DIR/SPLIT.gold (its words) with at most --max-words tokens
(punctuation included) is parsed by nltk's ViterbiParser, tagging on its own.

Resumable: FILE.jsonl starts with the settings, then holds one JSON line per parsed sentence
(index in the split, seconds, fallback, tree); a rerun skips the sentences already there, so
an interrupted run goes on where it stopped. At the end, or at once with --score-only, it
prints EVALB's labelled and unlabelled precision, recall and F1 (COLLINS.prm rules, the
`aiayn parse eval` scorer) over the sentences in the file, with the counts of sentences and
fallbacks (right-branching trees where the parser found no parse or ran out of time), the
tagging accuracy and the total parse seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

from nltk.tree import Tree

from aiayn.parsing import pcfg
from aiayn.parsing.trees import to_line


def read_trees(path: Path) -> list[Tree]:
    """One tree a line; ValueError names the file and line of one nltk cannot read."""
    out = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            try:
                out.append(Tree.fromstring(line))
            except ValueError as err:
                raise ValueError(f"{path}, line {i}: not a tree ({err})") from None
    return out


def load_records(path: Path, settings: dict, sentences: list[list[str]], *,
                 score_only: bool = False) -> dict[int, dict]:
    """The sentences already parsed into ``path`` (index -> record); writes the settings
    line when the file is new or empty, and cuts off a last line left half-written by an
    interrupted run. With ``score_only`` only the split must match the file's settings.

    Raises:
        ValueError: no file to score, a file written with other settings, a line that is not
            JSON, or a tree whose words are not the sentence's (other data).
    """
    if score_only and not path.is_file():
        raise ValueError(f"no {path} to score")
    if not path.exists() or path.stat().st_size == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            f.write(json.dumps({"settings": settings}) + "\n")
        return {}
    text = path.read_text(encoding="utf-8")
    if not text.endswith("\n"):
        keep = text.rfind("\n") + 1
        print(f"{path}: dropping a half-written last line", file=sys.stderr)
        with path.open("r+", encoding="utf-8") as f:
            f.truncate(len(text[:keep].encode("utf-8")))
        text = text[:keep]
    written, records = pcfg.read_parses(path, sentences)
    if score_only and written.get("split") == settings["split"]:
        settings.update(written)  # reported with the scores
    elif written != settings:
        raise ValueError(f"{path} was written with settings {written}, not {settings}: give "
                         "another --out")
    return records


def summarize(records: list[dict], golds: list[Tree], n_selected: int) -> dict:
    """Scores and counts over ``records`` (aligned with ``golds``)."""
    tests = [Tree.fromstring(r["tree"]) for r in records]
    scores = pcfg.score(golds, tests)
    tags = [(g, t) for gold, test in zip(golds, tests)
            for (_, g), (_, t) in zip(gold.pos(), test.pos())]
    return {
        "labeled": scores["labeled"].to_dict(), "unlabeled": scores["unlabeled"].to_dict(),
        "sentences": len(records), "selected": n_selected,
        "fallbacks": dict(Counter(r["fallback"] for r in records if r["fallback"])),
        "tagging_accuracy": round(100.0 * sum(g == t for g, t in tags) / len(tags), 2)
        if tags else 0.0,
        "parse_seconds": round(sum(r["seconds"] for r in records), 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default="runs/parse/data", metavar="DIR",
                   help="folder written by `aiayn parse prepare`")
    p.add_argument("--split", default="test", choices=("dev", "test"), help="split to parse")
    p.add_argument("--max-words", type=int, default=40, metavar="N",
                   help="parse only sentences of at most N tokens; 0: all")
    p.add_argument("--limit", type=int, default=0, metavar="K",
                   help="only the first K of those sentences; 0: all")
    p.add_argument("--out", required=True, metavar="FILE.jsonl",
                   help="one JSON line per parsed sentence; appended to and resumed from")
    p.add_argument("--min-word-count", type=int, default=2, metavar="C",
                   help="training words seen fewer times become unknown-word classes")
    p.add_argument("--min-rule-count", type=int, default=1, metavar="C",
                   help="drop phrasal rules seen fewer times (faster, less accurate)")
    p.add_argument("--max-seconds", type=float, default=0, metavar="S",
                   help="give a sentence up (right-branching fallback) after S seconds; 0: never")
    p.add_argument("--score-only", action="store_true", help="score the file, parse nothing")
    p.add_argument("--json", action="store_true", help="print the scores as one JSON object")
    args = p.parse_args()
    for name in ("max_words", "limit", "max_seconds"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")

    data = Path(args.data)
    gold_path, train_path = data / f"{args.split}.gold", data / "train.gold"
    for path in (gold_path, train_path):
        if not path.is_file():
            p.error(f"{path} is missing: run `aiayn parse prepare --out {data}` first")
    golds = read_trees(gold_path)
    # the real words (SPLIT.src is the Transformer's input, with rare words as their class)
    sentences = [g.leaves() for g in golds]
    selected = [i for i, w in enumerate(sentences) if not args.max_words
                or len(w) <= args.max_words]
    if args.limit:
        selected = selected[: args.limit]
    settings = {"split": args.split, "min_word_count": args.min_word_count,
                "min_rule_count": args.min_rule_count, "max_seconds": args.max_seconds}
    out = Path(args.out)
    try:
        records = load_records(out, settings, sentences, score_only=args.score_only)
    except ValueError as err:
        p.error(str(err))

    todo = [i for i in selected if i not in records]
    if todo and not args.score_only:
        t0 = time.perf_counter()
        model = pcfg.induce(read_trees(train_path), min_word_count=args.min_word_count,
                            min_rule_count=args.min_rule_count)
        print(f"grammar from {train_path} in {time.perf_counter() - t0:.1f} s: "
              f"{json.dumps(model.sizes())}", flush=True)
        print(f"{len(selected)} sentences of {len(sentences)} selected, {len(records)} already "
              f"in {out}, {len(todo)} to parse", flush=True)
        with out.open("a", encoding="utf-8") as f:
            for k, i in enumerate(todo, 1):
                result = pcfg.parse(model, sentences[i], max_time_s=args.max_seconds or None)
                rec = {"index": i, "n_words": len(sentences[i]),
                       "seconds": round(result.seconds, 3), "fallback": result.fallback,
                       "log_prob": result.log_prob, "tree": to_line(result.tree)}
                f.write(json.dumps(rec) + "\n")
                f.flush()
                records[i] = rec
                print(f"[{k}/{len(todo)}] sentence {i}: {len(sentences[i])} words, "
                      f"{result.seconds:.1f} s" + (f", {result.fallback}" if result.fallback
                                                   else ""), flush=True)

    done = [i for i in selected if i in records]
    summary = summarize([records[i] for i in done], [golds[i] for i in done], len(selected))
    summary["settings"] = settings
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"PCFG baseline on {args.split}, sentences of <= {args.max_words or 'any'} words: "
          f"{summary['sentences']} of {summary['selected']} parsed, fallbacks "
          f"{summary['fallbacks'] or 0}, {summary['parse_seconds']} s of parsing")
    for kind in ("labeled", "unlabeled"):
        s = summary[kind]
        print(f"  {kind:9s} P {s['precision']:6.2f}  R {s['recall']:6.2f}  F1 {s['f1']:6.2f}  "
              f"(exact {s['exact_match']})")
    print(f"  tagging accuracy {summary['tagging_accuracy']:.2f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
