"""A treebank PCFG, the baseline the Transformer parser of §6.3 must beat: a grammar read off
the training trees with nltk, parent-annotated and Markovized, parsing with nltk's Viterbi
parser and tagging on its own (no gold part-of-speech tags).

The steps, each nltk's own:

1. :func:`annotate`: a cleaned tree is put under ``ROOT`` (one start symbol for trees rooted
   in S, SINV, NP, FRAG …), every phrasal node gets its parent's label (``NP^<S>``; parent
   annotation, Johnson 1998, "PCFG Models of Linguistic Tree Representations", Computational
   Linguistics 24(4)) and nodes with more than two children are right-binarized with a
   horizontal Markov order of 1 (``NP@<JJ>^<S>``: the intermediate node remembers one sibling;
   Klein & Manning 2003, "Accurate Unlexicalized Parsing", ACL), by
   ``Tree.chomsky_normal_form(horzMarkov=1, vertMarkov=1)``. Part-of-speech tags are not
   annotated and unary rules are kept (nltk's Viterbi parser takes them), so no
   ``collapse_unary`` is needed.
2. Unknown words (:func:`signature`): training words seen fewer than ``min_word_count`` times
   are replaced by a class such as ``<UNK-Cap-ing>`` (capitalization, digit, dash, suffix), and
   so is every test word outside the training vocabulary, backing off to coarser classes when
   its own was never seen, so every sentence is covered and the grammar tags by itself.
3. :func:`induce`: ``nltk.induce_pcfg`` (relative frequencies); rules seen fewer than
   ``min_rule_count`` times may be dropped to trade accuracy for speed.
4. :func:`parse`: ``nltk.ViterbiParser`` finds the most probable tree. It tries every rule of
   the grammar on every span, lexical ones included, so each sentence is parsed with the
   grammar cut down to its own words (:meth:`TreebankPCFG.sentence_grammar`): the other words'
   probability mass goes to one terminal that cannot occur, so every probability, and so the
   Viterbi tree, is the full grammar's. :func:`unannotate` (``un_chomsky_normal_form``) turns
   the result back into a tree comparable with the gold; a sentence with no parse (or over the
   time limit) gets the right-branching tree, and :class:`Parse` says so.
5. :func:`score`: :func:`aiayn.parsing.evalb.score_corpus`, labelled and unlabelled.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from dataclasses import dataclass

from nltk.grammar import PCFG, Nonterminal, ProbabilisticProduction, induce_pcfg
from nltk.parse import ViterbiParser
from nltk.tree import Tree

from aiayn.parsing.evalb import BracketScore, score_corpus
from aiayn.parsing.trees import right_branching

ROOT = "ROOT"
CHILD_CHAR = "@"  # marks binarization nodes; nltk's default "|" is in the PTB label ADVP|PRT
PARENT_CHAR = "^"
NO_WORD = "<no word>"  # the one terminal of the mass of words outside a sentence
_SUFFIXES = ("ing", "ion", "ity", "ble", "ive", "ous", "est", "ed", "ly", "er", "al", "ic", "s")


def annotate(tree: Tree) -> Tree:
    """A copy of a cleaned tree under ``ROOT``, parent-annotated and right-binarized with
    horizontal Markov order 1 (module docstring, step 1).

    Raises:
        ValueError: a label already holds :data:`CHILD_CHAR` or :data:`PARENT_CHAR` (the
            transform could not be undone), or is ``ROOT``.
    """
    for sub in tree.subtrees():
        label = sub.label()
        if CHILD_CHAR in label or PARENT_CHAR in label or label == ROOT:
            raise ValueError(f"label {label!r} holds {CHILD_CHAR!r} or {PARENT_CHAR!r} or is "
                             f"{ROOT!r}: the annotation could not be undone")
    out = Tree(ROOT, [tree.copy(deep=True)])
    out.chomsky_normal_form(factor="right", horzMarkov=1, vertMarkov=1,
                            childChar=CHILD_CHAR, parentChar=PARENT_CHAR)
    return out


def unannotate(tree: Tree) -> Tree:
    """The plain tree of an annotated one (:func:`annotate`'s output or a parse): intermediate
    nodes spliced out, parent annotations cut, ``ROOT`` removed. The input is not changed.

    Raises:
        ValueError: the tree is not rooted in ``ROOT`` over one child.
    """
    if tree.label() != ROOT or len(tree) != 1 or not isinstance(tree[0], Tree):
        raise ValueError(f"not an annotated tree (expected ({ROOT} X)): {str(tree)[:80]}")
    out = Tree.convert(tree)  # a plain deep copy, also of a ProbabilisticTree
    out.un_chomsky_normal_form(expandUnary=False, childChar=CHILD_CHAR, parentChar=PARENT_CHAR)
    return out[0]


def signature(word: str) -> list[str]:
    """Unknown-word classes of ``word``, most specific first, ending with ``<UNK>``: the
    features are capitalization (``Cap``, ``Caps`` for all capitals), a digit (``Num``), a
    dash (``Dash``) and, for lower-case alphabetic endings, one of a few suffixes (``-ing``)."""
    feats = []
    if word[:1].isupper():
        feats.append("Caps" if word.isupper() and len(word) > 1 else "Cap")
    if any(c.isdigit() for c in word):
        feats.append("Num")
    if "-" in word:
        feats.append("Dash")
    suffix = next((s for s in _SUFFIXES if word.endswith(s) and len(word) > len(s) + 2
                   and word[-len(s) - 1].isalpha()), None)
    classes = []
    if suffix:
        classes.append("<UNK-" + "-".join([*feats, suffix]) + ">")
    for k in range(len(feats), 0, -1):
        classes.append("<UNK-" + "-".join(feats[:k]) + ">")
    classes.append("<UNK>")
    return classes


@dataclass(frozen=True)
class WordClasses:
    """Which words a model keeps as themselves and what the others become (step 2): the one
    owner of that choice for the PCFG and for the Transformer parser's input.

    Attributes:
        known: training words seen at least ``min_count`` times, kept as themselves.
        classes: unknown-word class -> how many training tokens it replaced.
    """

    known: frozenset[str]
    classes: Counter

    @classmethod
    def count(cls, sentences: Iterable[Iterable[str]], min_count: int) -> WordClasses:
        """The classes of training ``sentences`` (lists of words): words seen fewer than
        ``min_count`` times become their most specific :func:`signature` class.

        Raises:
            ValueError: ``min_count`` below 1, or a known word spelled like a class.
        """
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        counts = Counter(w for s in sentences for w in s)
        known = frozenset(w for w, n in counts.items() if n >= min_count)
        classes: Counter = Counter()
        for word, n in counts.items():
            if word not in known:
                classes[signature(word)[0]] += n
        clash = sorted(w for w in known if w == NO_WORD or w in classes)
        if clash:
            raise ValueError(f"training words that look like unknown-word classes: {clash[:5]}")
        return cls(known, classes)

    def terminal(self, word: str) -> str:
        """``word`` in any sentence: itself when known, else its most specific unknown-word
        class seen in training, else the most frequent class.

        Raises:
            ValueError: an unknown word and no unknown-word class at all (``min_count`` 1).
        """
        if word in self.known:
            return word
        for cls in signature(word):
            if cls in self.classes:
                return cls
        if not self.classes:
            raise ValueError(f"unknown word {word!r} and no unknown-word class: count the "
                             "classes with min_count >= 2")
        return self.classes.most_common(1)[0][0]


class TreebankPCFG:
    """An induced grammar with its vocabulary and unknown-word classes; made by :func:`induce`.

    Attributes:
        grammar: the nltk PCFG (start symbol ``ROOT``) over annotated labels.
        known_words: training words kept as themselves.
        unknown_classes: class -> training tokens replaced by it.
    """

    def __init__(self, grammar: PCFG, known_words: frozenset[str],
                 unknown_classes: Counter) -> None:
        self.grammar = grammar
        self.known_words = known_words
        self.unknown_classes = unknown_classes
        self._words = WordClasses(known_words, unknown_classes)
        self._phrasal: list[ProbabilisticProduction] = []
        lexical: dict[str, list[ProbabilisticProduction]] = defaultdict(list)
        for prod in grammar.productions():
            if prod.is_lexical():
                lexical[prod.rhs()[0]].append(prod)
            else:
                self._phrasal.append(prod)
        self._lexical = dict(lexical)

    def sizes(self) -> dict[str, int]:
        """Numbers of rules (phrasal and lexical), nonterminals and terminals."""
        nonterminals = {p.lhs() for p in self.grammar.productions()}
        return {"rules": len(self.grammar.productions()), "phrasal_rules": len(self._phrasal),
                "lexical_rules": sum(len(v) for v in self._lexical.values()),
                "nonterminals": len(nonterminals), "terminals": len(self._lexical),
                "known_words": len(self.known_words),
                "unknown_classes": len(self.unknown_classes)}

    def terminal(self, word: str) -> str:
        """The grammar's terminal for ``word`` (:meth:`WordClasses.terminal`).

        Raises:
            ValueError: an unknown word and a grammar with no unknown-word class at all.
        """
        return self._words.terminal(word)

    def sentence_grammar(self, terminals: Iterable[str]) -> PCFG:
        """The grammar with only the lexical rules of ``terminals``; each tag's other words
        are pooled into one rule ``TAG -> NO_WORD`` so every probability is unchanged.

        Raises:
            ValueError: a terminal the grammar does not have.
        """
        wanted = dict.fromkeys(terminals)  # ordered, so ties between trees break the same way
        missing = sorted(t for t in wanted if t not in self._lexical)
        if missing:
            raise ValueError(f"terminals not in the grammar: {missing[:10]}")
        kept = [p for t in wanted for p in self._lexical[t]]
        mass: dict[Nonterminal, float] = defaultdict(float)
        for p in kept:
            mass[p.lhs()] += p.prob()
        # tags with none of these words are left without lexical rules: nothing uses them
        rest = [ProbabilisticProduction(tag, [NO_WORD], prob=1.0 - m)
                for tag, m in mass.items() if 1.0 - m > 1e-12]
        return PCFG(self.grammar.start(), self._phrasal + kept + rest,
                    calculate_leftcorners=False)


def induce(trees: Iterable[Tree], *, min_word_count: int = 2,
           min_rule_count: int = 1) -> TreebankPCFG:
    """Read a PCFG off cleaned training trees (module docstring, steps 1-3).

    Args:
        trees: cleaned trees (:func:`aiayn.parsing.trees.clean`), not changed.
        min_word_count: words seen fewer times become unknown-word classes; 1 keeps every
            word (and leaves no class for unseen words).
        min_rule_count: phrasal rules seen fewer times are dropped (1 keeps all); lexical
            rules are always kept.

    Raises:
        ValueError: counts below 1, no trees, or a label :func:`annotate` refuses.
    """
    if min_word_count < 1 or min_rule_count < 1:
        raise ValueError(f"min_word_count and min_rule_count must be >= 1, got "
                         f"{min_word_count} and {min_rule_count}")
    trees = list(trees)
    if not trees:
        raise ValueError("no training trees")
    words = WordClasses.count((t.leaves() for t in trees), min_word_count)
    productions: Counter = Counter()
    for tree in trees:
        annotated = annotate(tree)
        for pos in annotated.treepositions("leaves"):
            annotated[pos] = words.terminal(annotated[pos])  # own class
        productions.update(annotated.productions())
    kept = [p for p, n in productions.items() if n >= min_rule_count or p.is_lexical()]
    grammar = induce_pcfg(Nonterminal(ROOT),
                          [p for p in kept for _ in range(productions[p])])
    return TreebankPCFG(grammar, words.known, words.classes)


@dataclass(frozen=True)
class Parse:
    """One sentence's result.

    Attributes:
        tree: a plain tree over the sentence's words (the right-branching one on fallback).
        fallback: None, ``"no parse"`` or ``"timeout"``.
        seconds: wall-clock seconds, grammar restriction included.
        log_prob: natural log of the Viterbi tree's probability; None on fallback, ``-inf``
            when the float product underflowed to 0.
    """

    tree: Tree
    fallback: str | None
    seconds: float
    log_prob: float | None


def parse(model: TreebankPCFG, words: list[str], *, max_time_s: float | None = None) -> Parse:
    """The Viterbi tree of ``words`` under ``model``, as a plain tree (module docstring, step 4).

    Args:
        max_time_s: give up after this many seconds (nltk's ``max_time``) and fall back;
            None: no limit (nltk's own default is 5 s).

    Raises:
        ValueError: no words.
    """
    if not words:
        raise ValueError("cannot parse an empty sentence")
    t0 = time.perf_counter()
    terminals = [model.terminal(w) for w in words]
    parser = ViterbiParser(model.sentence_grammar(terminals), max_time=max_time_s)
    try:
        found = next(parser.parse(terminals), None)
    except TimeoutError:
        return Parse(right_branching(words), "timeout", time.perf_counter() - t0, None)
    if found is None:
        return Parse(right_branching(words), "no parse", time.perf_counter() - t0, None)
    prob = found.prob()
    tree = unannotate(found)
    for pos, word in zip(tree.treepositions("leaves"), words):
        tree[pos] = word
    return Parse(tree, None, time.perf_counter() - t0, math.log(prob) if prob > 0 else -math.inf)


def score(golds: list[Tree], tests: list[Tree]) -> dict[str, BracketScore]:
    """EVALB's labelled and unlabelled corpus figures (COLLINS.prm rules).

    Raises:
        ValueError: as :func:`aiayn.parsing.evalb.score_corpus`.
    """
    return {"labeled": score_corpus(golds, tests, labeled=True),
            "unlabeled": score_corpus(golds, tests, labeled=False)}


def read_parses(path: str | Path, sentences: list[list[str]]) -> tuple[dict, dict[int, dict]]:
    """A parse file of ``bench/pcfg_baseline.py``: its settings (first line) and its records,
    sentence index -> ``{"index", "tree", ...}`` (one JSON object a line).

    Args:
        sentences: the split's tokenized sentences; every record's tree must have the words
            of the sentence it names.

    Raises:
        ValueError: a line that is not a JSON record, or a tree whose words are not its
            sentence's (file and line named).
    """
    path = Path(path)
    settings: dict = {}
    records: dict[int, dict] = {}
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if n == 1 and "settings" in rec:
                    settings = rec["settings"] or {}
                    continue
                i, tree = int(rec["index"]), Tree.fromstring(rec["tree"])
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{path}, line {n}: not a parse record ({err})") from None
            if not 0 <= i < len(sentences) or tree.leaves() != sentences[i]:
                raise ValueError(f"{path}, line {n}: the tree of sentence {i} does not have "
                                 "the words of this split's sentence: written from other data?")
            records[i] = rec
    return settings, records
