"""Parsing (§6.3): linearization round trips on every tree of the PTB sample, well-formed
outputs from repair and from constrained decoding, the split by file, and EVALB's rules on
hand-computed cases."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from nltk.tree import Tree

from aiayn.cli.parse import word_vocabulary
from aiayn.config import ModelConfig
from aiayn.model import Transformer
from aiayn.parsing.decode import parse
from aiayn.parsing.evalb import score_corpus, score_pair
from aiayn.parsing.trees import (
    CLOSE,
    PLACEHOLDER,
    TARGET_FORMS,
    TargetForm,
    canonical,
    clean,
    delinearize,
    is_well_formed,
    linearize,
    read_treebank,
    repair,
    right_branching,
    split_by_file,
    to_line,
)

T = Tree.fromstring


@pytest.fixture(scope="module")
def treebank(data_dir: Path) -> dict[str, list[Tree]]:
    path = data_dir / "ptb-sample" / "treebank.zip"
    if not path.is_file():
        pytest.skip(f"no {path}")
    return read_treebank(path)


FORMS = [TargetForm.from_name(n) for n in TARGET_FORMS]


def test_linearization_round_trips_on_every_tree_of_the_sample(treebank):
    n = 0
    for trees in treebank.values():
        for tree in trees:
            cleaned = clean(tree)
            words, target = linearize(cleaned)
            assert is_well_formed(target, len(words))
            back = delinearize(target, words)
            assert back.leaves() == words == cleaned.leaves()
            assert linearize(back) == (words, target)
            if n % 50 == 0:  # the brackets are the tree's: same labels, same spans
                assert score_pair(cleaned, back).f1 == 100.0
                for form in FORMS:  # every form reads back as the plain one
                    w, other = linearize(cleaned, form)
                    assert w == words and canonical(other, form) == (target, True)
            n += 1
    assert n == 3914


def test_target_forms():
    tree = T("(S (NP (NNP John)) (VP (VBD ran)) (. .))")
    assert linearize(tree, TargetForm(words=True))[1] == \
        ["(S", "(NP", "John", ")", "(VP", "ran", ")", ".", ")"]
    assert linearize(tree, TargetForm(labelled_close=True))[1] == \
        ["(S", "(NP", "XX", ")NP", "(VP", "XX", ")VP", "XX", ")S"]
    assert [f.name for f in FORMS] == ["xx", "words", "xx+labelled-close",
                                       "words+labelled-close"]
    assert all(TargetForm.from_name(f.name) == f for f in FORMS)
    with pytest.raises(ValueError, match="unknown target form 'tags'"):
        TargetForm.from_name("tags")
    # a close that does not match its open bracket makes the output malformed
    assert canonical(["(S", "(NP", "XX", ")VP", "XX", ")S"], FORMS[2])[1] is False
    # in the xx forms a stray token stays stray (not well-formed); in the words forms it is a word
    assert canonical(["(S", "dog", ")"], FORMS[0])[0] == ["(S", "dog", ")"]
    assert canonical(["(S", "dog", ")"], FORMS[1])[0] == ["(S", "XX", ")"]


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.name)
def test_word_vocabulary_keeps_words_seen_min_count_times(form):
    from aiayn.data.vocab import UNK_ID
    from aiayn.errors import UserError

    trees = [T("(S (NP (DT the) (NN cat)) (VP (VBD sat)))"),
             T("(S (NP (DT the) (NNS dogs)) (VP (VBD sat) (ADVP (RB here))))")]
    pairs = [linearize(t, form) for t in trees]
    sources, targets = [p[0] for p in pairs], [p[1] for p in pairs]
    every = word_vocabulary(sources, targets)
    frequent = word_vocabulary(sources, targets, min_count=2)
    table = frequent.tokenizer.get_vocab()
    # the tree tokens stay whatever their count; the words form's words are not tree tokens
    assert {t for tgt in targets for t in tgt if t not in sources[0] + sources[1]} <= set(table)
    assert {"the", "sat"} <= set(table) and not {"cat", "dogs", "here"} & set(table)
    assert len(every) == len(frequent) + 3
    assert frequent.encode("the cat sat") == [table["the"], UNK_ID, table["sat"]]
    with pytest.raises(UserError, match="at least 1"):
        word_vocabulary(sources, targets, min_count=0)


def test_clean_removes_empty_elements_and_function_tags():
    tree = T("(S (NP-SBJ-1 (-NONE- *-2)) (NP-SBJ (NNP John)) (VP (VBD ran) (NP (-NONE- *T*))) "
             "(. .))")
    assert clean(tree) == T("(S (NP (NNP John)) (VP (VBD ran)) (. .))")
    words, target = linearize(clean(tree))
    assert words == ["John", "ran", "."]
    assert target == ["(S", "(NP", "XX", ")", "(VP", "XX", ")", "XX", ")"]


def test_split_is_by_whole_file_and_contiguous(treebank):
    split = split_by_file(list(treebank))
    assert sorted(split["train"] + split["dev"] + split["test"]) == sorted(treebank)
    assert not set(split["dev"]) & set(split["test"])
    assert not set(split["train"]) & (set(split["dev"]) | set(split["test"]))
    assert max(split["train"]) < min(split["dev"]) and max(split["dev"]) < min(split["test"])
    with pytest.raises(ValueError):
        split_by_file(["a", "b"])


def test_well_formedness_rules():
    assert is_well_formed(["(S", "XX", ")"], 1)
    assert not is_well_formed(["(S", "XX", ")"], 2)  # a word missing
    assert not is_well_formed(["(S", "(NP", ")", "XX", ")"], 1)  # empty constituent
    assert not is_well_formed(["(S", "XX", ")", "(S", "XX", ")"], 2)  # two roots
    assert not is_well_formed(["(S", "XX"], 1)  # unbalanced
    assert not is_well_formed(["XX"], 1)  # no bracket
    assert not is_well_formed(["(S", "dog", ")"], 1)  # a stray token


def test_repair_always_gives_a_well_formed_tree():
    rng = random.Random(0)
    pool = ["(S", "(NP", "(VP", CLOSE, PLACEHOLDER, "<unk>"]
    for _ in range(3000):
        n = rng.randint(1, 8)
        target = [rng.choice(pool) for _ in range(rng.randint(0, 20))]
        fixed = repair(target, n)
        assert is_well_formed(fixed, n), (target, fixed)
    good = ["(S", "(NP", "XX", ")", "XX", ")"]
    assert repair(good, 2) == good


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.name)
def test_constrained_decoding_of_an_untrained_model_is_always_well_formed(form):
    sentences = [["the", "cat", "sat"], ["dogs", "bark", "."], ["a"], ["x"] * 9,
                 ["unseen", "words"]]
    trees = [T("(S (NP (DT the) (NN cat)) (VP (VBD sat)))"),
             T("(S (NP (NNS dogs)) (VP (VBP bark)) (. .))")]
    vocab = word_vocabulary(sentences[:4], [linearize(t, form)[1] for t in trees])
    torch.manual_seed(0)
    model = Transformer(ModelConfig(N=1, d_model=16, d_ff=32, h=2, d_k=8, d_v=8, P_drop=0.0,
                                    vocab_size=len(vocab), max_len=64)).eval()
    # an output layer limited to the training targets (model.output_vocab = "target"): in the
    # words form an unseen word (<unk>) is outside it, and must still be placed
    limited = Transformer(ModelConfig(N=1, d_model=16, d_ff=32, h=2, d_k=8, d_v=8, P_drop=0.0,
                                      vocab_size=len(vocab), max_len=64,
                                      output_vocab="target")).eval()
    seen = sorted({i for t in trees for i in vocab.encode(" ".join(linearize(t, form)[1]))})
    limited.limit_output_vocab(torch.tensor([*seen, 2]))  # and EOS
    for beam, m in ((1, model), (3, model), (3, limited)):
        out = parse(m, vocab, sentences, beam_size=beam, alpha=0.3, max_len_b=12,
                    form=form)
        for words, target in zip(sentences, out):
            plain, matched = canonical(target, form)
            assert matched and is_well_formed(plain, len(words)), (beam, words, target)
            assert delinearize(plain, words).leaves() == words
            if form.words:  # the words themselves, in order (<unk> for unseen ones)
                assert [t for t in target if t[0] not in "()"] == \
                    [w if w in vocab.tokenizer.get_vocab() else "<unk>" for w in words]
    # without constraints the same model does not produce trees
    raw = parse(model, vocab, sentences, beam_size=3, max_len_b=12, constrained=False,
                form=form)
    assert not all(canonical(t, form)[1] and is_well_formed(canonical(t, form)[0], len(w))
                   for w, t in zip(sentences, raw))


# --- EVALB under COLLINS.prm, counted by hand ---------------------------------------------

def test_evalb_identical_trees():
    g = T("(S (NP (DT the) (NN cat)) (VP (VBD sat)) (. .))")
    s = score_pair(g, g)
    assert (s.matched, s.gold, s.test, s.f1) == (3, 3, 3, 100.0)


def test_evalb_hand_computed_precision_and_recall():
    # gold brackets (punctuation deleted, words 0-2): S(0,3) NP(0,2) VP(2,3)
    # test: S(0,3) NP(0,1) VP(1,3) ADJP(1,2)  -> 1 match of 3 gold, 4 test
    g = T("(S (NP (DT the) (NN cat)) (VP (VBD sat)) (. .))")
    t = T("(S (NP (DT the)) (VP (ADJP (NN cat)) (VBD sat)) (. .))")
    s = score_pair(g, t)
    assert (s.matched, s.gold, s.test) == (1, 3, 4)
    assert s.precision == pytest.approx(25.0) and s.recall == pytest.approx(100 / 3)
    assert s.f1 == pytest.approx(2 * 25 * (100 / 3) / (25 + 100 / 3))


def test_evalb_ignores_punctuation_attachment_by_the_gold_tags():
    g = T("(S (NP (PRP it)) (VP (VBZ is) (ADJP (JJ odd))) (. .))")
    t = T("(S (NP (XX it)) (VP (XX is) (ADJP (XX odd)) (XX .)))")  # "." inside the VP
    assert score_pair(g, t).f1 == 100.0
    # a bracket over punctuation only disappears: (S , ...) has no extra bracket
    g2 = T("(S (NP (NN x)) (PRN (, ,) (: --)) (VP (VBD y)))")
    s = score_pair(g2, T("(S (NP (XX x)) (XX ,) (XX --) (VP (XX y)))"))
    assert (s.gold, s.test, s.matched) == (3, 3, 3)


def test_evalb_advp_equals_prt_and_labels_matter():
    g = T("(S (NP (PRP I)) (VP (VB give) (PRT (RP up))))")
    assert score_pair(g, T("(S (NP (PRP I)) (VP (VB give) (ADVP (RP up))))")).f1 == 100.0
    s = score_pair(g, T("(S (NP (PRP I)) (VP (VB give) (PP (RP up))))"))
    assert (s.matched, s.gold) == (3, 4)
    assert score_pair(g, T("(S (NP (PRP I)) (VP (VB give) (PP (RP up))))"),
                      labeled=False).f1 == 100.0


def test_evalb_counts_brackets_as_a_multiset():
    g = T("(S (NP (NP (NN x))) (VP (VBD y)))")  # NP(0,1) twice
    s = score_pair(g, T("(S (NP (NN x)) (VP (VBD y)))"))
    assert (s.matched, s.gold, s.test) == (3, 4, 3)
    assert s.precision == 100.0 and s.recall == 75.0


def test_evalb_corpus_totals_and_word_mismatch():
    g = [T("(S (NP (NN a)) (VP (VB b)))"), T("(S (NP (NN c)) (VP (VB d)))")]
    t = [g[0], T("(S (VP (NN c) (VB d)))")]
    total = score_corpus(g, t)
    assert (total.matched, total.gold, total.test, total.sentences, total.exact) == (4, 6, 5, 2, 1)
    with pytest.raises(ValueError, match="sentence 1"):
        score_corpus([g[0]], [T("(S (NP (NN z)) (VP (VB b)))")])


def test_right_branching_baseline_shape():
    tree = right_branching(["a", "b", "c", "d"])
    assert tree == T("(S (XX a) (NP (XX b) (NP (XX c) (XX d))))")
    assert right_branching(["a"]).leaves() == ["a"]


# --- aiayn parse eval on a run --------------------------------------------------------------

def test_parse_eval_of_a_runs_checkpoint_writes_into_the_run_with_its_chosen_alpha(
        tmp_path, capsys):
    """``aiayn parse eval RUN/best`` loads through the one loader: it decodes with the alpha
    and beam the run chose (its generation record), not the checkpoint's own, and writes
    SPLIT.parsed and SPLIT.results.json into RUN, not the folder above it. An ``--alpha``
    given still wins."""
    import json

    from aiayn.checkpoint import save_checkpoint
    from aiayn.cli import main
    from aiayn.config import Config, DecodeConfig
    from aiayn.rundir import RunDir

    form = TargetForm.from_name("xx")
    trees = [T("(S (NP (DT the) (NN cat)) (VP (VBD sat)))"),
             T("(S (NP (NNS dogs)) (VP (VBP bark)) (. .))")]
    words = [t.leaves() for t in trees]
    data = tmp_path / "data"
    data.mkdir()
    (data / "test.src").write_text("".join(" ".join(w) + "\n" for w in words))
    (data / "test.gold").write_text("".join(to_line(t) + "\n" for t in trees))
    (data / "split.json").write_text(json.dumps({"target_form": form.name}))
    vocab = word_vocabulary(words, [linearize(t, form)[1] for t in trees])
    own = DecodeConfig(beam_size=2, alpha=0.3, max_len_b=12)
    config = Config(name="parse-test", decode=own, model=ModelConfig(
        N=1, d_model=16, d_ff=32, h=2, d_k=8, d_v=8, P_drop=0.0, vocab_size=len(vocab),
        max_len=64))
    torch.manual_seed(0)
    run = RunDir(tmp_path / "run")
    save_checkpoint(run.best, Transformer(config.model), config, vocab)
    run.train_summary.write_text("{}")
    chosen = DecodeConfig(beam_size=3, alpha=1.1, max_len_b=12)
    run.write_generation([run.best], chosen, precision="fp32")

    def evaluate(*extra: str) -> dict:
        assert main(["parse", "eval", str(run.best), "--data", str(data), "--no-progress",
                     "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    res = evaluate()
    assert (res["alpha"], res["beam_size"]) == (chosen.alpha, chosen.beam_size)
    assert res["model_folders"] == [str(run.best)]
    assert json.loads((run / "test.results.json").read_text()) == res
    assert len((run / "test.parsed").read_text().splitlines()) == len(trees)
    assert not (tmp_path / "test.parsed").exists()
    assert not (tmp_path / "test.results.json").exists()
    assert evaluate("--alpha", "0.5")["alpha"] == 0.5
