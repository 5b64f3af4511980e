"""Make docs/serve-page.png: start ``aiayn serve`` on 127.0.0.1, type sentences into the page in
headless Chromium (Playwright with Debian's ``chromium``), pick a kind, layer and head, and
take a screenshot.

    python docs/make_screenshot.py --checkpoint runs/multi30k-en-de -o docs/serve-page.png
"""

from __future__ import annotations

import argparse
import shutil

from playwright.sync_api import expect, sync_playwright

from aiayn.serve.loadtest import serve_child


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("-o", "--output", default="docs/serve-page.png")
    p.add_argument("--text", default="A dog carries a stick in its mouth.\n"
                                     "Two young children are playing in the sand.")
    p.add_argument("--kind", default="encoder")
    p.add_argument("--layer", default="0", help="0-based, as the page's select values")
    p.add_argument("--head", default="all")
    args = p.parse_args()
    with serve_child(args.checkpoint) as (_, url):
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=shutil.which("chromium"),
                                         args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1000, "height": 800})
            page.goto(url + "/")
            expect(page.locator("#info")).to_contain_text("heads")
            page.fill("#source", args.text)
            page.fill("#nbest", "3")
            page.click("#translate")
            expect(page.locator("#attention svg line.weight").first).to_be_attached(
                timeout=120_000)
            page.select_option("#kind", args.kind)
            page.select_option("#layer", args.layer)
            page.select_option("#head", args.head)
            page.screenshot(path=args.output, full_page=True)
            browser.close()


if __name__ == "__main__":
    main()
