"""Labelled-bracket precision, recall and F1 as EVALB computes them under its standard
parameter file COLLINS.prm (Sekine & Collins 1997), with PYEVALB reading the trees.

COLLINS.prm rules applied here:
- ``DELETE_LABEL TOP -NONE- , : `` '' .``: words whose *gold* part-of-speech is one of these
  are removed from both trees before spans are counted (so punctuation attachment never
  matters), as are constituents left empty; TOP and -NONE- brackets are not counted;
- ``EQ_LABEL ADVP PRT``: the two labels are one;
- ``LABELED 1``: a bracket matches when label and span both match. Brackets are a multiset:
  two identical unary brackets in the gold tree need two in the test tree.
Preterminals (part-of-speech nodes) are never brackets. Function tags (``NP-SBJ``) are cut off.

PYEVALB parses each bracket string and gives every constituent its span; its own scorer
counts brackets as a set and applies no parameter file, so the matching is done here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from nltk.tree import Tree

from aiayn.parsing.trees import base_label, to_line

DELETE_LABELS = frozenset({"TOP", "-NONE-", ",", ":", "``", "''", "."})
EQUAL_LABELS = {"PRT": "ADVP"}


@dataclass
class BracketScore:
    """Totals over a corpus; precision, recall and F1 in percent (EVALB's "Bracketing")."""

    matched: int = 0
    gold: int = 0
    test: int = 0
    sentences: int = 0
    exact: int = 0

    def add(self, other: BracketScore) -> None:
        self.matched += other.matched
        self.gold += other.gold
        self.test += other.test
        self.sentences += other.sentences
        self.exact += other.exact

    @property
    def precision(self) -> float:
        return 100.0 * self.matched / self.test if self.test else 0.0

    @property
    def recall(self) -> float:
        return 100.0 * self.matched / self.gold if self.gold else 0.0

    @property
    def f1(self) -> float:
        p, r = self.precision, self.recall
        return 2 * p * r / (p + r) if p + r else 0.0

    def to_dict(self) -> dict:
        return {"precision": round(self.precision, 2), "recall": round(self.recall, 2),
                "f1": round(self.f1, 2), "matched": self.matched, "gold_brackets": self.gold,
                "test_brackets": self.test, "sentences": self.sentences,
                "exact_match": self.exact}


def _pos_tags(tree: Tree) -> list[str]:
    return [label for _, label in tree.pos()]


def _prune(tree: Tree, keep: list[bool], i: list[int]) -> Tree | None:
    """Drop the words whose ``keep`` is False (indexed in leaf order) and emptied brackets."""
    if isinstance(tree[0], str):
        ok = keep[i[0]]
        i[0] += 1
        return Tree(tree.label(), list(tree)) if ok else None
    kids = [c for c in (_prune(k, keep, i) for k in tree) if c is not None]
    return Tree(tree.label(), kids) if kids else None


def brackets(tree: Tree, keep: list[bool], labeled: bool = True) -> Counter:
    """EVALB's brackets of ``tree`` after deleting the words not in ``keep``: a multiset of
    (label, start, end), read with PYEVALB."""
    from PYEVALB import parser as pyevalb_parser

    pruned = _prune(tree, keep, [0])
    if pruned is None:
        return Counter()
    # PYEVALB splits each "word_POS" on "_", so a word with "_" in it would shift the spans:
    # spans depend only on leaf order, so words are replaced by their index.
    numbered = pruned.copy(deep=True)
    for n, pos in enumerate(numbered.treepositions("leaves")):
        numbered[pos] = f"w{n}"
    out: Counter = Counter()
    for node in pyevalb_parser.create_from_bracket_string(to_line(numbered)).non_terminal_labels:
        label = base_label(node.value)
        if label in DELETE_LABELS:
            continue
        label = EQUAL_LABELS.get(label, label) if labeled else ""
        out[(label, node.span.s, node.span.e)] += 1
    return out


def score_pair(gold: Tree, test: Tree, labeled: bool = True) -> BracketScore:
    """EVALB's counts for one sentence.

    Raises:
        ValueError: the two trees do not have the same words (EVALB's "words unmatched").
    """
    if gold.leaves() != test.leaves():
        raise ValueError(f"words differ: gold {gold.leaves()[:8]}… test {test.leaves()[:8]}…")
    keep = [tag not in DELETE_LABELS for tag in _pos_tags(gold)]
    g, t = brackets(gold, keep, labeled), brackets(test, keep, labeled)
    matched = sum((g & t).values())
    return BracketScore(matched, sum(g.values()), sum(t.values()), 1, int(g == t))


def score_corpus(golds: list[Tree], tests: list[Tree], labeled: bool = True) -> BracketScore:
    """Summed counts over aligned gold and test trees (EVALB's corpus figures).

    Raises:
        ValueError: different numbers of trees, or a sentence whose words differ (named).
    """
    if len(golds) != len(tests):
        raise ValueError(f"{len(golds)} gold trees but {len(tests)} test trees")
    total = BracketScore()
    for i, (g, t) in enumerate(zip(golds, tests), 1):
        try:
            total.add(score_pair(g, t, labeled))
        except ValueError as err:
            raise ValueError(f"sentence {i}: {err}") from None
    return total
