"""docs/wmt14.md's recipe as a reader runs it: every ``bash`` block of the page, in order, in
one shell, on a slice: ``aiayn fetch wmt14`` from small archives shaped as WMT14's (served from
127.0.0.1), then clean, vocab, prepare, torchrun train with the base preset's global batch,
average, evaluate with a hypothesis file, rescoring, the dev set, and the one-GPU pipeline.

Only sizes change, by the substitutions in :data:`SHRINK` (a tiny model, a few steps, two
processes for eight, a small vocabulary, the local archives); each must match the page exactly
as often as stated, so a page that changes under the test fails it instead of being skipped.
The fetch table of the page is checked against :data:`aiayn.data.fetch.WMT14`.
"""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import pytest

from aiayn.data.fetch import WMT14

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "wmt14.md"

# a model of seconds standing in for base; the data, batch and schedule options are the recipe's
TINY = ["model.N=1", "model.d_model=32", "model.d_ff=64", "model.h=2", "model.d_k=16",
        "model.d_v=16", "train.max_steps=4", "train.warmup_steps=2",
        "train.checkpoint_every_steps=2", "train.checkpoint_every_s=0", "train.precision=fp32",
        "train.eval_every_steps=4", "train.eval_bleu_sentences=0", "train.log_every_steps=1"]
PAIRS = (600, 300, 100)  # Europarl, Common Crawl, News Commentary: 1,000 pairs in all
TEST_PAIRS = 40


def shrink(mirror: str, manifest: Path, port: int) -> list[tuple[str, str, int]]:
    """(text of the page, what the test runs instead, how many times the page has it)."""
    tiny = " ".join(f"--set {item}" for item in TINY)
    return [
        ("aiayn fetch wmt14 -o wmt14",
         f"aiayn fetch wmt14 -o wmt14 --mirror {mirror} --manifest {manifest} --no-progress", 1),
        ("--size 37000", "--size 1000", 1),
        ("torchrun --nproc-per-node 8", f"torchrun --nproc-per-node 2 --master-port {port}", 1),
        ("--preset base", f"--preset base --device cpu --no-progress {tiny}", 2),
    ]


def _synthetic():
    spec = importlib.util.spec_from_file_location("synthetic_corpus",
                                                  ROOT / "bench" / "synthetic_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block of a Markdown page, in order."""
    return [(m[1], m[2]) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S)]


def test_every_block_of_the_page_says_what_it_is():
    """A block without a language could hold a command the recipe test never runs."""
    blocks = fenced_blocks(DOC.read_text(encoding="utf-8"))
    assert blocks and all(lang in ("bash", "text") for lang, _ in blocks), \
        [(lang, body[:40]) for lang, body in blocks]
    commands = "".join(body for lang, body in blocks if lang == "bash")
    for command in ("aiayn fetch wmt14", "python -m aiayn.data.clean", "aiayn vocab",
                    "aiayn prepare", "torchrun --nproc-per-node", "aiayn average",
                    "aiayn evaluate", "--output", "aiayn pipeline", "newstest2014"):
        assert command in commands, command


def test_the_fetch_table_is_the_built_in_manifest():
    """The page's table of archives, sums, member paths and line counts is aiayn's own."""
    rows = [line for line in DOC.read_text(encoding="utf-8").splitlines()
            if line.startswith("| ") and ".tgz`" in line]
    assert len(rows) == len(WMT14["archives"])
    for archive, row in zip(WMT14["archives"], rows):
        assert f"| `{archive['url']}` | {archive['bytes']:,} | `{archive['sha256']}` |" in row
    for corpus, row in zip(WMT14["train"], rows):
        assert row.startswith(f"| {corpus['name']} |")
        en, de = corpus["files"]["en"], corpus["files"]["de"]
        assert en[:-3] == de[:-3] and f"`{en[:-3]}.{{en,de}}`" in row
        assert row.endswith(f"| {corpus['lines']:,} |")
    test_row = rows[len(WMT14["train"])]
    assert all(f"{c['name']}" in test_row for c in WMT14["test"])
    assert "; ".join(f"{c['lines']:,}" for c in WMT14["test"]) in test_row
    for c in WMT14["test"]:
        en, de = c["files"]["en"], c["files"]["de"]
        assert (f"`{en[:-3]}.{{en,de}}`" in test_row if en[:-3] == de[:-3]
                else f"`{en}`" in test_row and f"`{de}`" in test_row)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_every_bash_block_of_the_page_runs_in_order(tmp_path: Path) -> None:
    www = tmp_path / "www"
    manifest = _synthetic().write_wmt14_archives(www, PAIRS, (TEST_PAIRS, TEST_PAIRS))
    manifest_path = tmp_path / "manifest.json"
    manifest_path.write_text(json.dumps(manifest), encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    data_dir = tmp_path / "data"
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                            partial(_Quiet, directory=str(www)))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        mirror = f"http://127.0.0.1:{httpd.server_address[1]}/"
        script = ["set -euo pipefail"]
        for n, (lang, body) in enumerate(fenced_blocks(DOC.read_text(encoding="utf-8"))):
            if lang == "bash":
                script += [f"echo '### block {n}'", body]
        script = "\n".join(script)
        for old, new, count in shrink(mirror, manifest_path, 27500 + os.getpid() % 1000):
            assert script.count(old) == count, f"the page has {old!r} " \
                f"{script.count(old)} times, the test expects {count}: update SHRINK"
            script = script.replace(old, new)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   AIAYN_DATA_DIR=str(data_dir), AIAYN_CACHE_DIR=str(tmp_path / "cache"),
                   PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        env.pop("AIAYN_DEBUG", None)
        env.pop("AIAYN_WMT14_MIRROR", None)
        res = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True,
                             text=True, timeout=600)
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]

    def lines(path: Path) -> int:
        return len(path.read_text(encoding="utf-8").splitlines())

    # 1. the fetch: the three corpora joined, the test sets where the recipe reads them
    assert lines(work / "wmt14" / "train.en") == lines(work / "wmt14" / "train.de") == 1000
    for name in ("newstest2013", "newstest2014"):
        assert lines(data_dir / "wmt14-en-de" / f"{name}.de") == TEST_PAIRS
    # 5. two processes share the base preset's 25000-token update
    assert ("global batch 2 process(es) x 1 accumulation step(s) x 12500 tokens = at most "
            "25000 tokens a side an update (data.global_max_tokens = 25000)") in out
    run = work / "runs" / "wmt14-base"
    config = json.loads((run / "config.json").read_text())
    assert (config["data"]["max_tokens"], config["data"]["global_max_tokens"]) == (12500, 25000)
    prepared = json.loads((work / "wmt14" / "prepared" / "manifest.json").read_text())
    assert json.loads((run / "data.json").read_text())["fingerprint"] == prepared["fingerprint"]
    # 6. a hypothesis file a line a segment, sacreBLEU's signature beside the paper's BLEU
    assert lines(run / "newstest2014.hyp.de") == TEST_PAIRS
    assert lines(run / "newstest2013.hyp.de") == TEST_PAIRS
    assert "nrefs:1|case:mixed" in out and "paper-style tokenized" in out
    assert "valid_ppl" in out
    # the one-GPU pipeline, in a run folder of its own
    assert lines(work / "runs" / "wmt14-base-1gpu" / "test.hyp.de") == TEST_PAIRS


def test_global_batch_sets_each_batch_and_is_logged(tmp_path: Path) -> None:
    """One process accumulating 2 batches under data.global_max_tokens = 2048: each batch is
    1024 tokens a side, the run says so at start, and its config.json records the 1024."""
    from aiayn.config import load_config
    from aiayn.training.run import run_training

    src, tgt = _synthetic().write_corpus(tmp_path / "raw", 200, types=2000, data_dir="")
    config = load_config("tiny", ["data.dataset=files", f"data.train_src={src}",
                                  f"data.train_tgt={tgt}", "data.global_max_tokens=2048",
                                  "data.max_tokens=0", "data.vocab_size=300",
                                  "train.accum_steps=2", "train.max_steps=2",
                                  "train.checkpoint_every_steps=0", "train.eval_every_steps=100"])
    lines: list[str] = []
    run_training(config, tmp_path / "run", progress=False, log=lines.append)
    assert ("aiayn train: global batch 1 process(es) x 2 accumulation step(s) x 1024 tokens = "
            "at most 2048 tokens a side an update (data.global_max_tokens = 2048)") in lines
    assert any("learned from all of 200 pairs" in line for line in lines)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["data"]
    assert (saved["max_tokens"], saved["global_max_tokens"]) == (1024, 2048)
