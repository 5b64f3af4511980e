"""``aiayn fetch wmt14``: download the WMT14 English-German training corpora and test sets,
checked against pinned sizes and sha256 sums, joined as the recipe (docs/wmt14.md) trains on
them. The work is :func:`aiayn.data.fetch.fetch`'s."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HELP = ("Download WMT14 en-de as the paper trained on it (Europarl v7, Common Crawl, News "
        "Commentary v9; newstest2013/2014), checked by size and sha256, resumable, joined into "
        "OUT/train.{en,de}.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from aiayn.data.fetch import MIRROR_ENV

    p.add_argument("dataset", choices=("wmt14",), help="what to fetch")
    p.add_argument("-o", "--out", default="wmt14", metavar="DIR",
                   help="folder for downloads/, train.en, train.de and fetch.json")
    p.add_argument("--test-dir", default=None, metavar="DIR",
                   help="where newstest2013/2014 .en/.de go (default: $AIAYN_DATA_DIR/"
                        "wmt14-en-de, where the recipe reads them; OUT/wmt14-en-de when "
                        "AIAYN_DATA_DIR is unset)")
    p.add_argument("--mirror", default=None, metavar="URL",
                   help=f"a folder URL holding the archives by name, used instead of "
                        f"statmt.org (http(s):// or file://; default: ${MIRROR_ENV})")
    p.add_argument("--manifest", default=None, metavar="FILE",
                   help="a JSON manifest of archives, sizes, sha256 sums, member paths and line "
                        "counts instead of the built-in one (aiayn.data.fetch.WMT14)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print what was written as one JSON "
                   "object")


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from aiayn.data.corpus import DATA_DIR_ENV, data_dir
    from aiayn.data.fetch import fetch, iter_summary, load_manifest
    from aiayn.fileio import check_output_dir

    def say(msg: str) -> None:
        if not args.json:
            print(f"aiayn fetch: {msg}", flush=True)

    manifest = load_manifest(args.manifest)
    if args.manifest:
        say(f"manifest {args.manifest} ({len(manifest.archives)} archives), not the built-in one")
    check_output_dir(args.out, "-o")
    if args.test_dir:
        check_output_dir(args.test_dir, "--test-dir")
    result = fetch(args.out, manifest=manifest, test_dir=args.test_dir, mirror=args.mirror,
                   progress=not args.no_progress and not args.json and sys.stderr.isatty(),
                   say=say)
    if args.json:
        print(json.dumps(asdict(result), ensure_ascii=False))
        return 0
    if not result.fetched:
        for line in iter_summary(result):
            say(line)
    if args.test_dir is None and data_dir() is None:
        say(f"{DATA_DIR_ENV} is unset: the test sets are in {result.test_dir}; export "
            f"{DATA_DIR_ENV}={Path(args.out).resolve()} for the recipe to find them there")
    return 0
