"""Write a synthetic WMT-shaped parallel corpus, deterministically, for the data benchmarks.

Each pair's (English, German) lengths in words are those of a newstest2013 line drawn at random
(``$AIAYN_DATA_DIR/wmt14-en-de/newstest2013.{en,de}``), so the length distribution, its tail and
the length ratio are WMT's. Words are drawn Zipf-distributed (exponent ``--zipf``) from
``--types`` word types per language; each type is a string of syllables, frequent types short,
so BPE learning meets a realistic long tail rather than repetition. Nothing else about the text
is real: it is for timing and memory, not for training a translator.

Run:  AIAYN_DATA_DIR=../shared/data python bench/make_synthetic_wmt.py --pairs 1000000 -o DIR
Writes DIR/train.en and DIR/train.de (plain UTF-8, one sentence a line). The same arguments
give the same bytes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ONSETS = ["", "b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
          "br", "st", "tr", "sch", "ch", "pl", "gr", "kl", "sp"]
VOWELS = ["a", "e", "i", "o", "u", "ei", "au", "ie", "ou", "ea"]
CODAS = ["", "", "n", "r", "s", "t", "l", "ng", "ck", "m"]


def word_table(types: int, seed: int) -> np.ndarray:
    """(types,) object array of distinct-looking words; rank 0 (most frequent) shortest."""
    rng = np.random.default_rng([seed, 1])
    syll = np.array([o + v + c for o in ONSETS for v in VOWELS for c in CODAS], dtype=object)
    ranks = np.arange(types)
    # 1-2 syllables for the top 100 types, up to 4 in the tail (Zipf's law of abbreviation)
    n_syll = np.clip(1 + np.log10(ranks + 1).astype(int) // 2 + rng.integers(0, 2, types), 1, 4)
    picks = rng.integers(0, len(syll), (types, 4))
    words = np.empty(types, dtype=object)
    for r in range(types):
        words[r] = "".join(syll[picks[r, : n_syll[r]]])
    return words


def zipf_cdf(types: int, exponent: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, types + 1, dtype=np.float64) ** exponent
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]


def newstest_lengths(data_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """Word counts of the aligned newstest2013 lines (en, de)."""
    out = []
    for lang in ("en", "de"):
        path = data_dir / "wmt14-en-de" / f"newstest2013.{lang}"
        if not path.is_file():
            raise SystemExit(f"make_synthetic_wmt: {path} not found; set AIAYN_DATA_DIR to the "
                             "folder holding wmt14-en-de/")
        lines = path.read_text(encoding="utf-8").split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        out.append(np.array([max(1, len(line.split())) for line in lines], dtype=np.int64))
    return out[0], out[1]


def sentences(words: np.ndarray, cdf: np.ndarray, lengths: np.ndarray,
              rng: np.random.Generator) -> str:
    """Lines of ``lengths[i]`` Zipf-drawn words each, joined into one text (trailing newline)."""
    total = int(lengths.sum())
    picked = words[np.searchsorted(cdf, rng.random(total))]
    seps = np.full(total, " ", dtype=object)
    seps[np.cumsum(lengths) - 1] = "\n"
    both = np.empty(2 * total, dtype=object)
    both[0::2], both[1::2] = picked, seps
    return "".join(both)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=1_000_000)
    p.add_argument("--types", type=int, default=2_000_000, help="word types per language")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of word frequencies")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk", type=int, default=100_000, help="pairs generated at once")
    p.add_argument("-o", "--output", required=True, type=Path)
    args = p.parse_args()
    data_dir = Path(os.environ.get("AIAYN_DATA_DIR", "../shared/data"))
    t0 = time.perf_counter()
    len_en, len_de = newstest_lengths(data_dir)
    tables = {"en": word_table(args.types, args.seed * 2 + 0),
              "de": word_table(args.types, args.seed * 2 + 1)}
    cdf = zipf_cdf(args.types, args.zipf)
    args.output.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([args.seed, 2])
    files = {lang: open(args.output / f"train.{lang}.part", "w", encoding="utf-8")
             for lang in ("en", "de")}
    try:
        for start in range(0, args.pairs, args.chunk):
            n = min(args.chunk, args.pairs - start)
            rows = rng.integers(0, len(len_en), n)
            for lang, lens in (("en", len_en[rows]), ("de", len_de[rows])):
                files[lang].write(sentences(tables[lang], cdf, lens, rng))
    finally:
        for f in files.values():
            f.close()
    for lang in ("en", "de"):
        os.replace(args.output / f"train.{lang}.part", args.output / f"train.{lang}")
    size = sum((args.output / f"train.{lang}").stat().st_size for lang in ("en", "de"))
    print(f"make_synthetic_wmt: {args.pairs:,} pairs, {size / 1e6:,.0f} MB in {args.output} "
          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
