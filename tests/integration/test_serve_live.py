"""``aiayn serve`` as a real process on 127.0.0.1: the page in a real browser (headless Debian
Chromium driven by Playwright) and a bounded loopback load test.

Outside CI, the browser test skips when no Chromium is installed; in CI (``CI`` set, as
``.ci/run`` does) a missing browser fails it, since ``.ci/run`` installs one."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest
from serving import artifacts_dir, serve_process, tiny_checkpoint

from aiayn.serve.loadtest import run_load

pytestmark = pytest.mark.slow  # a live server, a browser and 2,000 requests


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live")
    # a model that tokenizes its input itself, as the main job's does (the page warns of input
    # that looks tokenized already)
    ckpt = tiny_checkpoint(tmp / "ckpt", preprocess="lc-norm-tok")
    # a small queue, so that the load test also meets the 429 path when it is full
    with serve_process(ckpt, "--max-queue-lines", "24", "--max-lines", "8",
                       "--max-batch-lines", "32", log=tmp / "serve.log") as (proc, url):
        yield proc, url


def chromium_path() -> str | None:
    for name in (os.environ.get("AIAYN_CHROMIUM"), "chromium", "chromium-browser",
                 "google-chrome"):
        if name and (path := shutil.which(name)):
            return path
    return None


def test_page_translates_and_draws_every_head(server):
    path = chromium_path()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("no Chromium found in CI: .ci/run should have installed `chromium`")
        pytest.skip("no Chromium installed (apt-get install chromium); CI installs it")
    from playwright.sync_api import expect, sync_playwright

    _, url = server
    shot = artifacts_dir() / "serve-page.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 900})
            errors = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(url + "/")
            expect(page.locator("#info")).to_contain_text("h=4 heads")
            page.fill("#source", "Two dogs play in the snow.\nA man rides a bike.")
            page.fill("#nbest", "2")
            page.click("#translate")
            best = page.locator(".result .translation")
            expect(best).to_have_count(2)
            expect(page.locator("#warning")).to_have_text("")
            expect(page.locator(".result").first.locator("table.nbest tr")).to_have_count(2)
            assert best.first.inner_text().strip()
            # a flagged line (issue 82) is marked, with its flags named, as the API flags it
            api = httpx.post(url + "/translate", json={"lines": ["Two dogs play in the snow.",
                             "A man rides a bike."], "nbest": 2}, timeout=30).json()
            flags = [line[0]["flags"] for line in api["translations"]]
            expect(page.locator(".result.flagged")).to_have_count(sum(map(bool, flags)))
            for i, names in enumerate(flags):
                if names:
                    expect(page.locator(f'.result[data-line="{i}"] > .flags')).to_have_text(
                        "\u26a0 " + ", ".join(names))
            # the attention of line 1's best translation is drawn on its own; pick a head
            expect(page.locator("#attention svg.lines line.weight").first).to_be_attached()
            page.select_option("#kind", "encoder")
            page.select_option("#layer", "0")
            for head in ("0", "1", "2", "3"):
                page.select_option("#head", head)
                lines = page.locator("#attention svg.lines line.weight")
                assert lines.count() > 0
                colours = {lines.nth(i).get_attribute("stroke") for i in range(lines.count())}
                assert len(colours) == 1  # one head, one colour
            expect(page.locator("#attention-caption")).to_contain_text("layer 1 of 2, head 4")
            page.select_option("#head", "all")
            page.select_option("#style", "heatmap")
            expect(page.locator("#attention svg.heatmap")).to_have_count(4)
            page.select_option("#kind", "cross")
            page.select_option("#style", "lines")
            # the second n-best entry of line 2 gets its own drawing
            page.locator('tr[data-line="1"][data-rank="1"] button').click()
            expect(page.locator('tr.shown[data-line="1"][data-rank="1"]')).to_have_count(1)
            expect(page.locator("#attention svg.lines line.weight").first).to_be_attached()
            page.screenshot(path=str(shot), full_page=True)
            # input tokenized already (Moses escapes) is translated, with a warning; the next
            # clean request clears it
            page.fill("#source", "a man &apos;s dog .")
            page.click("#translate")
            expect(page.locator("#warning")).to_contain_text("look tokenized already")
            expect(page.locator(".result .translation")).to_have_count(1)
            page.fill("#source", "A man's dog.")
            page.click("#translate")
            expect(page.locator(".result .source")).to_have_text("A man's dog.")
            expect(page.locator("#warning")).to_have_text("")
            assert not errors, errors
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000


def test_loopback_load_every_request_answered(server):
    proc, url = server
    report = run_load(url + "/translate", {"lines": ["Two dogs play in the snow."], "beam": 1},
                      requests=2000, concurrency=32, request_timeout_s=30, time_limit_s=150)
    (artifacts_dir() / "load-test.json").write_text(json.dumps(
        {**report.__dict__, "summary": report.summary()}, indent=2))
    print("\nload test (tiny model, beam 1): " + report.summary())
    assert report.errors == {}, report.summary()  # nothing dropped, nothing hung
    assert report.answered == 2000
    assert set(report.statuses) <= {200, 429}, report.summary()
    assert report.statuses.get(200, 0) >= 1000, report.summary()
    assert proc.poll() is None  # the server survived it
