"""docs/architecture.md's layout lists every module of src/aiayn and every test folder, so it
cannot go stale silently: a module added or renamed without its line fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "aiayn"


def layout_entries() -> dict[str, str]:
    """The "## Layout" block of docs/architecture.md: each folder or file path it lists, with
    its text (continuation lines joined)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}
    key = None
    for line in block.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            key, _, rest = line.partition(" ")
            entries[key] = rest
        elif key is not None:
            entries[key] += " " + line.strip()
    return entries


def missing_modules(entries: dict[str, str]) -> list[str]:
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if path.parent == PACKAGE:
            if rel not in entries:
                missing.append(rel)
        elif path.name != "__init__.py":
            folder = path.parent.relative_to(ROOT).as_posix() + "/"
            if not re.search(rf"(?<![\w.]){re.escape(path.name)}", entries.get(folder, "")):
                missing.append(rel)
    return missing


def test_every_module_is_in_the_architecture_page():
    missing = missing_modules(layout_entries())
    assert not missing, ("docs/architecture.md's Layout does not list: " + ", ".join(missing))


def test_every_test_folder_is_in_the_architecture_page():
    tests = layout_entries()["tests/"]
    folders = sorted(p.name for p in (ROOT / "tests").iterdir()
                     if p.is_dir() and not p.name.startswith((".", "_")))
    assert folders and all(f"{name}/" in tests for name in folders), (folders, tests)


def test_a_module_left_out_is_found():
    """The check can fail: dropping one module's name from its folder's line is noticed."""
    entries = layout_entries()
    entries["src/aiayn/model/"] = entries["src/aiayn/model/"].replace("quantize.py", "")
    assert missing_modules(entries) == ["src/aiayn/model/quantize.py"]
    del entries["src/aiayn/rundir.py"]
    assert "src/aiayn/rundir.py" in missing_modules(entries)
