"""Penn Treebank trees: reading (nltk), cleaning, a split by file, and the linearization of
Vinyals & Kaiser et al. (2014, "Grammar as a Foreign Language").

Linearization: the source is the sentence's words; the target is the bracketed tree, depth
first, with each open bracket written with its label (``(NP``), each close bracket as a bare
``)`` and each part-of-speech node with its word replaced by the placeholder ``XX``::

    (S (NP (NNP John)) (VP (VBZ has) (NP (DT a) (NN dog))) (. .))
    -> (S (NP XX ) (VP XX (NP XX XX ) ) XX )

POS tags are not predicted, as in their setup (EVALB ignores them for bracket F1);
:func:`delinearize` labels preterminals ``XX``. Two variants (:class:`TargetForm`, chosen by
``aiayn parse prepare`` and kept in the data folder's ``split.json``):

- ``labelled_close``: each close bracket carries its label, as Vinyals et al. write it
  (``)NP``); the label is implied by the open bracket, so this only gives the decoder a
  reminder of what it is closing;
- ``words``: each word itself in place of ``XX`` (``(S (NP John ) …``), so the decoder reads
  where in the sentence it is instead of counting placeholders; decoding forces the next word.

Every form maps to the plain one by :func:`canonical`; the rest of this module works on that.
"""

from __future__ import annotations

import io
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from nltk.corpus.reader.util import read_sexpr_block
from nltk.tree import Tree

from aiayn.errors import ConfigError, DataError

PLACEHOLDER = "XX"
CLOSE = ")"


# what `aiayn parse prepare` writes unless told otherwise: the form that scored best on dev
# (docs/experiments.md, "Constituency parsing")
DEFAULT_TARGET_FORM = "words+labelled-close"


@dataclass(frozen=True)
class TargetForm:
    """How a tree is written as target tokens (module docstring)."""

    labelled_close: bool = False  # ")NP" instead of ")"
    words: bool = False  # the words themselves instead of "XX"

    @property
    def name(self) -> str:
        """``xx``, ``words``, ``xx+labelled-close`` or ``words+labelled-close``."""
        return ("words" if self.words else "xx") + ("+labelled-close" if self.labelled_close
                                                     else "")

    @classmethod
    def from_name(cls, name: str) -> TargetForm:
        """The inverse of :attr:`name`.

        Raises:
            ValueError: an unknown name."""
        base, _, extra = name.partition("+")
        if base not in ("xx", "words") or extra not in ("", "labelled-close"):
            raise ValueError(f"unknown target form {name!r}: expected xx or words, optionally "
                             "with +labelled-close")
        return cls(labelled_close=bool(extra), words=base == "words")


# every form's name, the plain one first: `aiayn parse prepare --target-form`'s choices
TARGET_FORMS = tuple(TargetForm(labelled_close=lc, words=w).name
                     for lc in (False, True) for w in (False, True))


def is_open(tok: str) -> bool:
    """``(X``: an open bracket."""
    return tok.startswith("(") and len(tok) > 1


def is_close(tok: str) -> bool:
    """``)`` or ``)X``: a close bracket."""
    return tok.startswith(")")
_FUNCTION_TAG = re.compile(r"^([^-=]+)[-=].*$")


def read_treebank(path: str | Path, max_files: int = 0) -> dict[str, list[Tree]]:
    """The trees of every ``.mrg`` file in the zip (nltk's treebank layout) or folder (only
    the first ``max_files`` in name order when it is not 0).

    Returns:
        file id (e.g. ``wsj_0001``) -> its trees, in file order, with the empty top bracket
        of the PTB removed.

    Raises:
        FileNotFoundError: nothing at ``path``.
        DataError: a file that is no zip archive, no ``.mrg`` files, or a tree nltk cannot
            read (file named).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no treebank at {path}")
    files: dict[str, str] = {}
    if path.is_file():
        try:
            with zipfile.ZipFile(path) as z:
                for name in sorted(z.namelist()):
                    if name.endswith(".mrg") and "/combined/" in f"/{name}":
                        files[Path(name).stem] = z.read(name).decode("utf-8")
        except zipfile.BadZipFile as err:
            raise DataError(f"{path}: not a zip archive of the treebank ({err})") from None
    else:
        for p in sorted(path.rglob("*.mrg")):
            files[p.stem] = p.read_text(encoding="utf-8")
    if max_files:
        files = dict(list(files.items())[:max_files])
    if not files:
        raise DataError(f"{path}: no .mrg files (expected treebank/combined/wsj_*.mrg)")
    out: dict[str, list[Tree]] = {}
    for file_id, text in files.items():
        stream, trees = io.StringIO(text), []
        while block := read_sexpr_block(stream):
            for s in block:
                try:
                    trees.append(Tree.fromstring(s, remove_empty_top_bracketing=True))
                except ValueError as err:
                    raise DataError(f"{path}: {file_id}, tree {len(trees) + 1}: {err}") from None
        out[file_id] = trees
    return out


def base_label(label: str) -> str:
    """``NP-SBJ-1`` -> ``NP``, ``PP=2`` -> ``PP``; labels starting with ``-`` (``-NONE-``,
    ``-LRB-``) are kept whole."""
    if label.startswith("-"):
        return label
    m = _FUNCTION_TAG.match(label)
    return m.group(1) if m else label


def clean(tree: Tree) -> Tree | None:
    """The tree without empty elements (``-NONE-``), constituents left empty by their removal,
    and function tags and indices on labels, the usual preparation for parsing (EVALB's
    COLLINS.prm deletes -NONE- as well). None when nothing is left."""
    if isinstance(tree[0], str):  # preterminal
        return None if tree.label() == "-NONE-" else Tree(tree.label(), list(tree))
    kids = [c for c in (clean(k) for k in tree) if c is not None]
    return Tree(base_label(tree.label()), kids) if kids else None


def check_fractions(dev_fraction: float, test_fraction: float) -> None:
    """Raises ValueError unless both shares are in (0, 1) and their sum is below 1."""
    if not (0 < dev_fraction < 1 and 0 < test_fraction < 1 and dev_fraction + test_fraction < 1):
        raise ConfigError(f"dev and test fractions must be in (0, 1) with a sum below 1, got "
                         f"{dev_fraction} and {test_fraction}")


def split_by_file(file_ids: list[str], dev_fraction: float = 0.1,
                  test_fraction: float = 0.1) -> dict[str, list[str]]:
    """Whole files to train / dev / test, contiguous in file order as the WSJ sections are
    (the last files are test, those before them dev), so no document is in two splits.

    Raises:
        ValueError: fractions outside (0, 1) or too few files for three splits.
    """
    ids = sorted(file_ids)
    check_fractions(dev_fraction, test_fraction)
    n_test = max(1, round(len(ids) * test_fraction))
    n_dev = max(1, round(len(ids) * dev_fraction))
    if len(ids) < n_test + n_dev + 1:
        raise ValueError(f"{len(ids)} files are too few for a train/dev/test split")
    return {"train": ids[: len(ids) - n_dev - n_test],
            "dev": ids[len(ids) - n_dev - n_test: len(ids) - n_test],
            "test": ids[len(ids) - n_test:]}


def linearize(tree: Tree, form: TargetForm = TargetForm()) -> tuple[list[str], list[str]]:
    """(words, target tokens) of a cleaned tree, written in ``form``; see the module
    docstring."""
    words: list[str] = []
    target: list[str] = []

    def walk(t: Tree) -> None:
        if isinstance(t[0], str):
            words.append(t[0])
            target.append(t[0] if form.words else PLACEHOLDER)
            return
        target.append("(" + t.label())
        for k in t:
            walk(k)
        target.append(CLOSE + t.label() if form.labelled_close else CLOSE)

    walk(tree)
    return words, target


def canonical(target: list[str], form: TargetForm) -> tuple[list[str], bool]:
    """``target``, written in ``form``, in the plain form (bare ``)``, and ``XX`` for every
    other token when ``form.words``; in the ``xx`` forms a stray token stays stray), and
    whether every labelled close bracket matched the bracket it closes (True for bare ones). A
    close that does not match makes the output malformed, as in Vinyals et al.; callers count
    it with the other repairs."""
    out: list[str] = []
    stack: list[str] = []
    matched = True
    for tok in target:
        if is_open(tok):
            stack.append(tok[1:])
            out.append(tok)
        elif is_close(tok):
            if len(tok) > 1 and (not stack or stack[-1] != tok[1:]):
                matched = False
            if stack:
                stack.pop()
            out.append(CLOSE)
        else:
            out.append(PLACEHOLDER if form.words else tok)
    return out, matched


def is_well_formed(target: list[str], n_words: int) -> bool:
    """True when ``target`` is one tree: balanced brackets, a single root, no empty
    constituent, no stray token, and exactly ``n_words`` placeholders."""
    depth = words = 0
    last = None
    for i, tok in enumerate(target):
        if tok.startswith("(") and len(tok) > 1:
            if depth == 0 and i > 0:
                return False  # a second root
            depth += 1
        elif tok == CLOSE:
            if depth == 0 or (last is not None and last.startswith("(") and len(last) > 1):
                return False
            depth -= 1
        elif tok == PLACEHOLDER:
            if depth == 0:
                return False
            words += 1
        else:
            return False
        last = tok
    return bool(target) and depth == 0 and words == n_words


def delinearize(target: list[str], words: list[str]) -> Tree:
    """The tree of a well-formed target, its placeholders replaced by ``words`` in order under
    preterminals labelled ``XX``.

    Raises:
        ValueError: ``target`` is not well-formed for ``len(words)`` words.
    """
    if not is_well_formed(target, len(words)):
        raise ValueError(f"not a well-formed tree for {len(words)} words: {' '.join(target)}")
    stack: list[Tree] = [Tree("", [])]
    it = iter(words)
    for tok in target:
        if tok == CLOSE:
            done = stack.pop()
            stack[-1].append(done)
        elif tok == PLACEHOLDER:
            stack[-1].append(Tree(PLACEHOLDER, [next(it)]))
        else:
            stack.append(Tree(tok[1:], []))
    return stack[0][0]


def repair(target: list[str], n_words: int) -> list[str]:
    """A well-formed target made from any token list: stray tokens and closes that would
    empty or unbalance a constituent are dropped, placeholders beyond ``n_words`` dropped,
    missing ones appended to the innermost open constituent, open brackets closed, and the
    whole wrapped in ``(S`` if it is not one tree. Used only when constrained decoding could
    not finish (the caller counts it)."""
    out: list[str] = []
    depth = words = 0
    for tok in target:
        if tok.startswith("(") and len(tok) > 1 and words < n_words and not (depth == 0 and out):
            out.append(tok)
            depth += 1
        elif tok == CLOSE and depth > 0 and not out[-1].startswith("("):
            if depth == 1 and words < n_words:
                continue  # closing the root now would leave words out
            out.append(tok)
            depth -= 1
        elif tok == PLACEHOLDER and depth > 0 and words < n_words:
            out.append(tok)
            words += 1
    if not out:
        out, depth = ["(S"], 1
    out += [PLACEHOLDER] * (n_words - words)
    while out and out[-1].startswith("(") and len(out[-1]) > 1:  # an empty trailing open
        out.pop()
        depth -= 1
    out += [CLOSE] * depth
    if not is_well_formed(out, n_words):
        out = ["(S", *out, CLOSE] if out else ["(S", *[PLACEHOLDER] * n_words, CLOSE]
    return out


def right_branching(words: list[str], root: str = "S", inner: str = "NP") -> Tree:
    """The right-branching baseline: (root w1 (inner w2 (inner w3 … ))) with preterminals
    ``XX``; the last two words share the innermost bracket."""
    leaves = [Tree(PLACEHOLDER, [w]) for w in words]
    if len(leaves) <= 2:
        return Tree(root, leaves)
    tree = Tree(inner, leaves[-2:])
    for leaf in reversed(leaves[1:-2]):
        tree = Tree(inner, [leaf, tree])
    return Tree(root, [leaves[0], tree])


def flat(words: list[str], root: str = "S") -> Tree:
    """The flat baseline: every word (preterminal ``XX``) directly under one ``root`` bracket,
    so only the sentence's own bracket can match."""
    return Tree(root, [Tree(PLACEHOLDER, [w]) for w in words])


def to_line(tree: Tree) -> str:
    """One-line bracketed form, as EVALB reads it."""
    return tree.pformat(margin=10**9)
