"""A deterministic WMT-shaped synthetic parallel corpus: aligned ``train.en`` / ``train.de``.

Sentence lengths (words) are drawn from newstest2013's own distribution when
``$AIAYN_DATA_DIR/wmt14-en-de/newstest2013.en`` exists (else from a log-normal of the same
mean, about 22 words); words are Zipf-distributed (exponent ``--zipf``) over ``--types`` word
types, so that BPE learning meets a long tail of rare words and is not made cheap by repetition.
A type's spelling is its rank written in syllables (base 64): frequent words are short, rare
ones long, as in real text. The target side spells the same ranks in reverse order with other
syllables (German-like letters, umlauts and ß included), a frequent word added one time in four:
the pairs are for data-pipeline and vocabulary work, not for learning to translate well.

Run:  python bench/synthetic_corpus.py --pairs 300000 --out /tmp/synth [--seed 1]

The same arguments give the same bytes on every machine (numpy's PCG64 generator).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

_EN_ONSETS = ["", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "th", "w"]
_EN_VOWELS = ["a", "e", "i", "o"]
_DE_ONSETS = ["", "b", "d", "f", "g", "h", "k", "l", "m", "n", "r", "s", "sch", "t", "w", "z"]
_DE_VOWELS = ["a", "e", "ä", "ü"]
_DE_CODAS = ["", "n", "ß", "ch"]  # a fourth of German syllables end in one of these


def _syllables(onsets: list[str], vowels: list[str]) -> list[str]:
    return [o + v for o in onsets for v in vowels]  # 64


def spell(ranks: np.ndarray, syllables: list[str], codas: list[str] | None = None) -> list[str]:
    """The spelling of each word rank: its base-64 digits as syllables (rank 0 = one syllable)."""
    out = []
    base = len(syllables)
    for r in ranks.tolist():
        parts = []
        r += 1
        while r:
            r, d = divmod(r - 1, base)
            parts.append(syllables[d])
        word = "".join(reversed(parts))
        if codas is not None:
            word += codas[len(word) % len(codas)]
        out.append(word)
    return out


def newstest_lengths(data_dir: str | None) -> np.ndarray | None:
    """Words per line of newstest2013's English side, or None when it is not at hand."""
    if not data_dir:
        return None
    path = Path(data_dir) / "wmt14-en-de" / "newstest2013.en"
    if not path.is_file():
        return None
    return np.array([len(line.split()) for line in path.read_text(encoding="utf-8").splitlines()
                     if line.strip()])


def generate(pairs: int, *, types: int = 1_000_000, zipf: float = 1.1, seed: int = 1,
             chunk: int = 50_000, lengths: np.ndarray | None = None):
    """Yield ``(source, target)`` lines, ``pairs`` of them, ``chunk`` pairs drawn at a time."""
    rng = np.random.Generator(np.random.PCG64(seed))
    weights = 1.0 / np.power(np.arange(1, types + 1, dtype=np.float64) + 2.7, zipf)
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    en_syl, de_syl = _syllables(_EN_ONSETS, _EN_VOWELS), _syllables(_DE_ONSETS, _DE_VOWELS)
    cache_en: dict[int, str] = {}
    cache_de: dict[int, str] = {}
    punct = np.array([".", ",", "?", "!", ";", ":"])
    done = 0
    while done < pairs:
        n = min(chunk, pairs - done)
        if lengths is not None:
            lens = rng.choice(lengths, size=n)
        else:
            lens = np.maximum(1, rng.lognormal(3.0, 0.5, size=n).astype(np.int64))
        ids = np.searchsorted(cdf, rng.random(int(lens.sum())))
        new = np.unique(ids)
        new = new[[int(i) not in cache_en for i in new.tolist()]]
        cache_en.update(zip(new.tolist(), spell(new, en_syl)))
        cache_de.update(zip(new.tolist(), spell(new, de_syl, _DE_CODAS)))
        ends = np.cumsum(lens)
        starts = ends - lens
        marks = punct[rng.integers(0, len(punct), size=n)]
        # a German sentence has one frequent word more than its English one, one time in four
        extra = np.where(rng.random(n) < 0.25, rng.integers(0, 8, size=n), -1)
        for s, e, mark, x in zip(starts.tolist(), ends.tolist(), marks.tolist(), extra.tolist()):
            words = ids[s:e].tolist()
            en = " ".join(cache_en[w] for w in words)
            de = " ".join(cache_de[w] for w in reversed(words))
            if x >= 0:
                de += " " + cache_de.setdefault(x, spell(np.array([x]), de_syl, _DE_CODAS)[0])
            yield en[:1].upper() + en[1:] + " " + mark, de[:1].upper() + de[1:] + " " + mark
        done += n


def write_corpus(out: str | Path, pairs: int, *, stem: str = "train", seed: int = 1,
                 types: int = 1_000_000, zipf: float = 1.1,
                 data_dir: str | None = None) -> tuple[Path, Path]:
    """Write ``OUT/STEM.en`` and ``OUT/STEM.de`` (``pairs`` aligned lines); their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    src, tgt = out / f"{stem}.en", out / f"{stem}.de"
    lengths = newstest_lengths(data_dir if data_dir is not None
                               else os.environ.get("AIAYN_DATA_DIR"))
    with open(src, "w", encoding="utf-8") as fs, open(tgt, "w", encoding="utf-8") as ft:
        for en, de in generate(pairs, types=types, zipf=zipf, seed=seed, lengths=lengths):
            fs.write(en + "\n")
            ft.write(de + "\n")
    return src, tgt


def write_wmt14_archives(out: str | Path, pairs: tuple[int, ...] = (600, 300, 100),
                         test_pairs: tuple[int, int] = (40, 40), *, seed: int = 1,
                         types: int = 5000, data_dir: str | None = "") -> dict:
    """Small archives shaped as WMT14's, for ``aiayn fetch wmt14 --mirror`` in tests: each
    training archive of :data:`aiayn.data.fetch.WMT14` holds ``pairs[i]`` synthetic pairs at
    the member paths of the real one (plus a member fetch must skip), and ``dev.tgz`` holds the
    two test sets (newstest2013 as text, newstest2014 as SGML, with stray spaces to tidy).

    Returns:
        the manifest (a dict shaped as ``WMT14``) with these archives' sizes, sha256 sums and
        line counts; the archives are ``OUT/NAME``.
    """
    import copy
    import hashlib
    import io
    import tarfile

    from aiayn.data.fetch import WMT14

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = copy.deepcopy(WMT14)
    manifest["source"] = "synthetic archives (bench/synthetic_corpus.py)"
    members: dict[str, list[tuple[str, bytes]]] = {a["name"]: [] for a in manifest["archives"]}

    def text(rows: list[str]) -> bytes:
        return "".join(r + "\n" for r in rows).encode("utf-8")

    for i, (corpus, n) in enumerate(zip(manifest["train"], pairs)):
        rows = list(generate(n, types=types, seed=seed + i,
                             lengths=newstest_lengths(data_dir)))
        members[corpus["archive"]] += [(corpus["files"]["en"], text([r[0] for r in rows])),
                                       (corpus["files"]["de"], text([r[1] for r in rows])),
                                       (corpus["files"]["en"] + ".other", b"skipped\n")]
        corpus["lines"] = n
    for j, (corpus, n) in enumerate(zip(manifest["test"], test_pairs)):
        rows = list(generate(n, types=types, seed=seed + 10 + j))
        for lang, side in (("en", 0), ("de", 1)):
            name = corpus["files"][lang]
            if name.endswith(".sgm"):
                body = ['<srcset setid="x" srclang="any">', '<doc docid="d" origlang="en">']
                body += [f'<seg id="{k + 1}">  {r[side]}\t </seg>' for k, r in enumerate(rows)]
                body += ["</doc>", "</srcset>"]
            else:
                body = [f"{r[side]} " for r in rows]
            members[corpus["archive"]].append((name, text(body)))
        corpus["lines"] = n
    for archive in manifest["archives"]:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for name, data in members[archive["name"]]:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        data = buf.getvalue()
        (out / archive["name"]).write_bytes(data)
        archive["bytes"], archive["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    return manifest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, required=True)
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--stem", default="train", help="file names: STEM.en, STEM.de")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--types", type=int, default=1_000_000, help="word types (Zipf's support)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent")
    args = p.parse_args()
    src, tgt = write_corpus(args.out, args.pairs, stem=args.stem, seed=args.seed,
                            types=args.types, zipf=args.zipf)
    print(f"wrote {args.pairs} pairs to {src} and {tgt}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
