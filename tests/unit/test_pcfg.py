"""The treebank PCFG baseline (§6.3): the tree transform undone exactly on real trees, parent
annotation and Markov order 1 on a hand-checked tree, unknown-word classes covering unseen
text, a grammar parsing its own training sentence back, the per-sentence grammar giving the
full grammar's tree, fallbacks, and clear errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from nltk.parse import ViterbiParser
from nltk.tree import Tree

from aiayn.parsing import pcfg
from aiayn.parsing.trees import clean, read_treebank, right_branching

T = Tree.fromstring


@pytest.fixture(scope="module")
def files(data_dir: Path) -> list[list[Tree]]:
    """Cleaned trees of the first 20 files of the PTB sample, file by file."""
    path = data_dir / "ptb-sample" / "treebank.zip"
    if not path.is_file():
        pytest.skip(f"no {path}")
    return [[clean(t) for t in trees] for trees in read_treebank(path, max_files=20).values()]


def test_annotate_then_unannotate_gives_the_real_trees_back(files):
    trees = [t for f in files for t in f]
    assert len(trees) == 233
    for tree in trees:
        before = tree.copy(deep=True)
        annotated = pcfg.annotate(tree)
        assert tree == before  # the input is left alone
        assert pcfg.unannotate(annotated) == tree
        assert all(len(s) <= 2 for s in annotated.subtrees())


def test_parent_annotation_and_horizontal_markov_order_1():
    tree = T("(S (NP (DT the) (JJ big) (JJ red) (NN dog)) (VP (VBZ barks)) (. .))")
    got = pcfg.annotate(tree)
    # the two intermediate NP nodes remember only the next sibling, so they share a label
    assert got == T("(ROOT (S^<ROOT> (NP^<S> (DT the) (NP@<JJ>^<S> (JJ big) "
                    "(NP@<JJ>^<S> (JJ red) (NN dog)))) (S@<VP>^<ROOT> (VP^<S> (VBZ barks)) "
                    "(. .))))")


def test_signature_backs_off_from_specific_to_unk():
    assert pcfg.signature("Reconstructing") == ["<UNK-Cap-ing>", "<UNK-Cap>", "<UNK>"]
    assert pcfg.signature("1.5-million") == ["<UNK-Num-Dash-ion>", "<UNK-Num-Dash>",
                                             "<UNK-Num>", "<UNK>"]
    assert pcfg.signature("IBM") == ["<UNK-Caps>", "<UNK>"]
    assert pcfg.signature("quickly") == ["<UNK-ly>", "<UNK>"]
    assert pcfg.signature("xyz") == ["<UNK>"]


def test_unseen_words_map_to_classes_the_grammar_has(files):
    model = pcfg.induce([t for f in files[:10] for t in f])
    sizes = model.sizes()
    assert sizes["unknown_classes"] > 5 and sizes["terminals"] < sizes["lexical_rules"]
    lexical = {p.rhs()[0] for p in model.grammar.productions() if p.is_lexical()}
    unseen = 0
    for tree in (t for f in files[10:] for t in f):
        for word in tree.leaves():
            terminal = model.terminal(word)
            assert terminal in lexical
            unseen += terminal != word
    assert unseen > 100


def test_word_classes_keep_frequent_words_and_class_the_rest():
    train = [["the", "dog", "barks"], ["the", "Dogs", "barking"], ["the", "dog", "sleeps"]]
    words = pcfg.WordClasses.count(train, min_count=2)
    assert words.known == {"the", "dog"}
    assert dict(words.classes) == {"<UNK-s>": 2, "<UNK-Cap-s>": 1, "<UNK-ing>": 1}
    assert [words.terminal(w) for w in train[1]] == ["the", "<UNK-Cap-s>", "<UNK-ing>"]
    # unseen words: their most specific class seen in training, then the most frequent one
    assert words.terminal("dog") == "dog"
    assert words.terminal("Cats") == "<UNK-Cap-s>"
    assert words.terminal("Cat") == "<UNK-s>"  # no <UNK-Cap> nor <UNK>: the most frequent
    assert words.terminal("walking") == "<UNK-ing>"
    with pytest.raises(ValueError, match="min_count >= 2"):
        pcfg.WordClasses.count(train, min_count=1).terminal("cat")
    with pytest.raises(ValueError, match="look like unknown-word classes"):
        pcfg.WordClasses.count([["<UNK-s>", "<UNK-s>", "hats"]], min_count=2)


def test_a_grammar_parses_its_own_training_sentence_back(files):
    trees = files[0] + files[1]  # wsj_0001-0002: three sentences
    model = pcfg.induce(trees, min_word_count=1)
    gold = trees[1]  # "Mr. Vinken is chairman of Elsevier N.V. , the Dutch publishing group ."
    result = pcfg.parse(model, gold.leaves())
    assert result.fallback is None and result.log_prob < 0
    assert result.tree == gold  # brackets and the tags it found on its own
    scores = pcfg.score([gold], [result.tree])
    assert scores["labeled"].f1 == scores["unlabeled"].f1 == 100.0


def test_the_sentence_grammar_gives_the_full_grammars_tree(files):
    model = pcfg.induce([t for f in files[:10] for t in f])
    words = files[17][23].leaves()  # not in training, half of its words unknown
    assert " ".join(words) == "No price for the new shares has been set ."
    terminals = [model.terminal(w) for w in words]
    assert any(t != w for t, w in zip(terminals, words))
    full = next(ViterbiParser(model.grammar, max_time=None).parse(terminals))
    result = pcfg.parse(model, words)
    assert result.fallback is None
    assert result.log_prob == pytest.approx(math.log(full.prob()))
    expected = pcfg.unannotate(full)
    for pos, word in zip(expected.treepositions("leaves"), words):
        expected[pos] = word
    assert result.tree == expected


def test_no_parse_and_timeout_fall_back_to_right_branching():
    model = pcfg.induce([T("(S (NP (DT The) (NN dog)) (VP (VBZ barks)) (. .))")],
                        min_word_count=1)
    words = ["barks", "The", "dog", "."]  # no rule starts a sentence with a verb
    result = pcfg.parse(model, words)
    assert result.fallback == "no parse" and result.log_prob is None
    assert result.tree == right_branching(words)
    timed_out = pcfg.parse(model, ["The", "dog", "barks", "."], max_time_s=0)
    assert timed_out.fallback == "timeout"


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="no training trees"):
        pcfg.induce([])
    with pytest.raises(ValueError, match="min_word_count"):
        pcfg.induce([T("(S (NN a))")], min_word_count=0)
    with pytest.raises(ValueError, match="'NP@X'"):
        pcfg.annotate(T("(S (NP@X (NN a)))"))
    with pytest.raises(ValueError, match="not an annotated tree"):
        pcfg.unannotate(T("(S (NN a))"))
    model = pcfg.induce([T("(S (NN a) (NN b))")], min_word_count=1)
    with pytest.raises(ValueError, match="no unknown-word class"):
        model.terminal("c")
    with pytest.raises(ValueError, match="empty sentence"):
        pcfg.parse(model, [])
