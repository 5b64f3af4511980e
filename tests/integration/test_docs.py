"""The documentation: the MkDocs site builds in strict mode (no broken link, no stale reference
in the API pages), and the README stays a short page for newcomers with one Python example."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README_MAX_BYTES = 15_000


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, (
        f"mkdocs build --strict exited with {result.returncode}\n"
        f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}")
    assert (tmp_path / "index.html").is_file()
    assert (tmp_path / "api" / "index.html").is_file()


def python_blocks_under(markdown: str, heading: str) -> list[str]:
    """The ```python blocks between ``heading`` and the next heading of the same or a higher
    level (fenced blocks are skipped when looking for headings)."""
    level = len(heading) - len(heading.lstrip("#"))
    blocks: list[str] = []
    inside, fence, lang, body = False, False, "", []
    for line in markdown.splitlines():
        if line.startswith("```"):
            if not fence:
                fence, lang, body = True, line[3:].strip(), []
            else:
                fence = False
                if inside and lang == "python":
                    blocks.append("\n".join(body))
            continue
        if fence:
            body.append(line)
            continue
        m = re.match(r"^(#+) ", line)
        if m:
            if line.strip() == heading:
                inside = True
            elif inside and len(m.group(1)) <= level:
                inside = False
    return blocks


def test_readme_is_short_with_one_python_example() -> None:
    readme = ROOT / "README.md"
    size = readme.stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; at most {README_MAX_BYTES}"
    text = readme.read_text(encoding="utf-8")
    assert text.count("\n## Python\n") == 1, "README.md needs one '## Python' heading"
    blocks = python_blocks_under(text, "## Python")
    assert len(blocks) == 1, f"expected one ```python block under '## Python', found {len(blocks)}"
    assert "from aiayn import Translator" in blocks[0]
