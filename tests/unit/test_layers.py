"""The package's layers: every import in src/aiayn (function-local and TYPE_CHECKING imports
included, read from the source, so nothing is hidden) points down this order, and no module
imports itself back through others (after torchtune's tests/test_import_recipes.py). A module
launched as a program (``[sys.executable, "-m", "aiayn.x", ...]``) counts as imported: a
library that runs ``python -m aiayn train`` in a child process depends on the command line as
much as one that imports it."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "aiayn"

# lowest first. A unit (a top-level module, or a subpackage with all its modules) may import
# units of lower layers only; units of one layer do not import each other.
LAYERS: list[list[str]] = [
    ["aiayn.errors"],
    ["aiayn.config", "aiayn.fileio", "aiayn.devices", "aiayn.budget"],
    ["aiayn.rundir"],  # the run directory's names and its model_paths() rule
    ["aiayn.model", "aiayn.data"],
    ["aiayn.precision", "aiayn.checkpoint", "aiayn.decoding", "aiayn.evaluation"],
    ["aiayn.interop", "aiayn.parsing", "aiayn.viz"],
    ["aiayn.pretrained"],  # loading a model from a path (the Translator's and --init-from's)
    ["aiayn.training"],  # trains; it decodes through aiayn.decoding, never the Translator
    ["aiayn.translator"],
    ["aiayn.selection", "aiayn.experiments", "aiayn.serve"],
    ["aiayn.pipeline"],  # the main job: train, choose on val, decode, score, results.json
    ["aiayn.cli"],  # parses arguments for the library and prints what it returns
    ["aiayn", "aiayn.__main__"],  # the package's lazy facade, and `python -m aiayn`
]

# edges against the order that are being removed; nothing else goes here
TEMPORARY_ALLOWED: set[tuple[str, str]] = set()

# what `python -m NAME` runs, where it is not NAME itself: the package's __main__ is the
# command line
LAUNCHED = {"aiayn": "aiayn.cli"}

# modules whose job is to run the command itself as a user does, in a child process (a load
# generator for `aiayn serve` and its tests): a launch of the command, not a use of it
COMMAND_LAUNCHERS = {"aiayn.serve.loadtest"}


def modules() -> dict[str, Path]:
    """Every module of src/aiayn by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[tuple[str, int]]:
    """(module imported, line) of every absolute or relative import of aiayn in ``path``,
    at any depth of the syntax tree."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    here = ".".join(path.relative_to(SRC).with_suffix("").parts).split(".")
    package = here[:-1]  # a module's package (an __init__'s is itself, less "__init__")
    out = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package[:len(package) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            # `from aiayn.data import text` imports the module aiayn.data.text
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        if isinstance(node, (ast.List, ast.Tuple)):  # [sys.executable, "-m", "aiayn.x", ...]
            items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            for flag, name in zip(items, items[1:]):
                if flag == "-m" and isinstance(name, str) and \
                        (name == "aiayn" or name.startswith("aiayn.")):
                    targets.append(LAUNCHED.get(name, name))
        for target in targets:
            if target == "aiayn" or target.startswith("aiayn."):
                while target not in known and "." in target:
                    target = target.rsplit(".", 1)[0]
                out.add((target, node.lineno))
    return out


def unit_of(module: str) -> str:
    """The layer unit of a module: its subpackage (aiayn.data.text -> aiayn.data) or itself."""
    parts = module.split(".")
    if len(parts) > 1 and (PACKAGE / parts[1]).is_dir():
        return ".".join(parts[:2])
    return module


def layer_of(unit: str) -> int:
    for n, layer in enumerate(LAYERS):
        if unit in layer:
            return n
    raise KeyError(unit)


def test_every_unit_has_a_layer():
    units = {unit_of(m) for m in modules()}
    missing = sorted(u for u in units if not any(u in layer for layer in LAYERS))
    assert not missing, f"give these a layer in LAYERS: {missing}"
    stale = sorted(u for layer in LAYERS for u in layer if u not in units)
    assert not stale, f"LAYERS names units that do not exist: {stale}"


def test_imports_point_down_the_layers():
    known = modules()
    wrong = []
    for module, path in known.items():
        src = unit_of(module)
        for target, line in imports(path, known):
            dst = unit_of(target)
            if dst == src or target == "aiayn":  # within a unit; the root's __version__
                continue
            if module in COMMAND_LAUNCHERS and dst == "aiayn.cli":
                continue
            if layer_of(dst) < layer_of(src) or (src, dst) in TEMPORARY_ALLOWED:
                continue
            wrong.append(f"{path.relative_to(SRC)}:{line}: {src} (layer {layer_of(src)}) "
                         f"imports {target} (layer {layer_of(dst)})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_the_temporary_allowlist_is_still_needed():
    """An edge that is gone leaves the allowlist, so the list cannot grow stale."""
    known = modules()
    used = {(unit_of(m), unit_of(t)) for m, p in known.items() for t, _ in imports(p, known)}
    assert TEMPORARY_ALLOWED <= used, f"no longer imported: {TEMPORARY_ALLOWED - used}"


def test_no_module_imports_itself_back():
    """No cycle among modules, function-local imports included (within a unit too)."""
    known = modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in known.items():
        for target, _ in imports(path, known):
            if target != module and target != "aiayn":
                graph[module].add(target)
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            pytest.fail("import cycle: " + " -> ".join(stack[stack.index(node):] + [node]))
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, stack + [node])
        done.add(node)

    for module in sorted(known):
        visit(module, [])


def test_the_checker_sees_hidden_imports(tmp_path):
    """A function-local import and a relative one are both found (the checker can fail)."""
    pkg = tmp_path / "aiayn"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "__init__.py").write_text("")
    (pkg / "translator.py").write_text("")
    (pkg / "data" / "text.py").write_text(
        "def f():\n    from aiayn.translator import Translator\n    from . import vocab\n"
        "    subprocess.run([sys.executable, '-m', 'aiayn', 'train'])\n"
        "    return (sys.executable, '-m', 'aiayn.translator')\n")
    (pkg / "data" / "vocab.py").write_text("")
    known = {"aiayn": pkg, "aiayn.translator": pkg / "translator.py", "aiayn.cli": pkg,
             "aiayn.data": pkg / "data", "aiayn.data.text": pkg / "data" / "text.py",
             "aiayn.data.vocab": pkg / "data" / "vocab.py"}
    global SRC
    saved, SRC = SRC, tmp_path
    try:
        found = imports(pkg / "data" / "text.py", known)
    finally:
        SRC = saved
    assert found == {("aiayn.translator", 2), ("aiayn.data.vocab", 3), ("aiayn.cli", 4),
                     ("aiayn.translator", 5)}


def test_the_checker_sees_an_ensemble_launch(tmp_path):
    """training/ensemble.py starts its members as programs: the launch is read as an import
    (of aiayn.training itself now; of aiayn.cli, against the layers, had it run `python -m
    aiayn train` as it once did)."""
    known = modules()
    path = known["aiayn.training.ensemble"]
    assert "aiayn.training.ensemble" in {t for t, _ in imports(path, known)}
    text = path.read_text(encoding="utf-8")
    assert '"-m", "aiayn.training.ensemble"' in text, "the members' launch moved: update me"
    copy = tmp_path / "aiayn" / "training" / "ensemble.py"
    copy.parent.mkdir(parents=True)
    copy.write_text(text.replace('"-m", "aiayn.training.ensemble"', '"-m", "aiayn", "train"'),
                    encoding="utf-8")
    global SRC
    saved, SRC = SRC, tmp_path
    try:
        found = {t for t, _ in imports(copy, known)}
    finally:
        SRC = saved
    assert "aiayn.cli" in found and layer_of("aiayn.cli") > layer_of("aiayn.training")
