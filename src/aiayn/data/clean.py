"""Clean a parallel training corpus the way WMT14 en-de is usually cleaned before training.

The rules are those of fairseq's ``prepare-wmt14en2de.sh`` (Moses ``clean-corpus-n.perl``
with ``-ratio 1.5``, lengths 1 to 250): a pair is dropped when a side is empty or longer than
``max_words``, or when one side has more than ``max_ratio`` times the other's words. Words are
counted on whitespace, in the text as distributed (fairseq counts after its own tokenization
and BPE, so it drops a few more long pairs). Everything is streamed: memory stays flat however
large the files.

Run:  python -m aiayn.data.clean --src train.en --tgt train.de \\
          --out-src train.clean.en --out-tgt train.clean.de

It prints what each rule dropped; the outputs appear only when complete (written beside their
final names, then renamed).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

MAX_WORDS = 250  # fairseq's prepare-wmt14en2de.sh: clean-corpus-n.perl ... 1 250
MAX_RATIO = 1.5  # ... -ratio 1.5


@dataclass
class CleanCounts:
    """Pairs read, kept, and dropped by each rule (the first rule a pair breaks counts it)."""

    read: int = 0
    kept: int = 0
    empty: int = 0
    too_long: int = 0
    ratio: int = 0


def keep_pair(src: str, tgt: str, counts: CleanCounts, max_words: int = MAX_WORDS,
              max_ratio: float = MAX_RATIO) -> bool:
    """Whether a pair passes the rules (the reason counted in ``counts`` when not)."""
    counts.read += 1
    a, b = len(src.split()), len(tgt.split())
    if a == 0 or b == 0:
        counts.empty += 1
        return False
    if a > max_words or b > max_words:
        counts.too_long += 1
        return False
    if a > max_ratio * b or b > max_ratio * a:
        counts.ratio += 1
        return False
    counts.kept += 1
    return True


def clean_files(src: str | Path, tgt: str | Path, out_src: str | Path, out_tgt: str | Path,
                max_words: int = MAX_WORDS, max_ratio: float = MAX_RATIO) -> CleanCounts:
    """Write the pairs of ``src``/``tgt`` (plain or ``.gz``) that pass :func:`keep_pair`, each
    stripped, to ``out_src``/``out_tgt`` (plain text, atomically).

    Raises:
        FileNotFoundError: an input is missing.
        DataError: the inputs' line counts differ, invalid UTF-8 (file and line named), a
            broken gzip stream.
    """
    from aiayn.data.vocab import count_lines, stream_lines
    from aiayn.errors import DataError
    from aiayn.fileio import atomic_file

    n_src, n_tgt = count_lines(src), count_lines(tgt)
    if n_src != n_tgt:
        raise DataError(f"{src} has {n_src} lines but {tgt} has {n_tgt}: source and target "
                        "files must be line-aligned")
    counts = CleanCounts()
    pairs: Iterator[tuple[str, str]] = zip(stream_lines(src), stream_lines(tgt), strict=True)
    with atomic_file(out_src, "w") as fs, atomic_file(out_tgt, "w") as ft:
        for s, t in pairs:
            if keep_pair(s, t, counts, max_words, max_ratio):
                fs.write(s + "\n")
                ft.write(t + "\n")
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiayn.data.clean",
                                description=__doc__.split("\n")[0])
    p.add_argument("--src", required=True, metavar="FILE")
    p.add_argument("--tgt", required=True, metavar="FILE")
    p.add_argument("--out-src", required=True, metavar="FILE")
    p.add_argument("--out-tgt", required=True, metavar="FILE")
    p.add_argument("--max-words", type=int, default=MAX_WORDS,
                   help=f"longest side kept, in words (default {MAX_WORDS})")
    p.add_argument("--max-ratio", type=float, default=MAX_RATIO,
                   help=f"largest words ratio between the sides (default {MAX_RATIO})")
    p.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    args = p.parse_args(argv)
    from aiayn.errors import UserError

    try:
        counts = clean_files(args.src, args.tgt, args.out_src, args.out_tgt, args.max_words,
                             args.max_ratio)
    except (UserError, FileNotFoundError) as err:
        print(f"aiayn clean: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(asdict(counts)))
    else:
        print(f"{counts.read} pairs read, {counts.kept} kept; dropped: {counts.empty} with an "
              f"empty side, {counts.too_long} over {args.max_words} words, {counts.ratio} with "
              f"a words ratio over {args.max_ratio}; wrote {args.out_src} and {args.out_tgt}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
