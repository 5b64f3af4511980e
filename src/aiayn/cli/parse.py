"""``aiayn parse``: English constituency parsing as translation (§6.3) on a Penn Treebank —
``prepare`` (read, split by file, linearize), ``train`` (the paper's parsing settings scaled
down, N = 2 chosen on dev) and ``eval`` (constrained beam search, EVALB-compatible F1, a
right-branching baseline)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

from aiayn.errors import UserError
from aiayn.rundir import TOKENIZER

HELP = ("Constituency parsing as in §6.3: `prepare` a treebank (split by file, linearized "
        "trees), `train` a 4-layer model, `eval` labelled-bracket F1 (EVALB, COLLINS.prm).")
SPLITS = ("train", "dev", "test")


def _default_treebank() -> str | None:
    root = os.environ.get("AIAYN_DATA_DIR")
    return str(Path(root) / "ptb-sample" / "treebank.zip") if root else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    from aiayn.cli import _HelpFormatter

    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True,
                           help="prepare, train or eval")
    pr = sub.add_parser("prepare", formatter_class=_HelpFormatter,
                        help="read the treebank, split it by file, write linearized pairs",
                        description="Read the .mrg trees with nltk, remove empty elements and "
                                    "function tags, split whole files into train/dev/test "
                                    "(contiguous, the last files test), and write "
                                    "SPLIT.src (words), SPLIT.tgt (linearized tree), SPLIT.gold "
                                    "(cleaned trees) and a word-level tokenizer.json.")
    pr.add_argument("--treebank", default=_default_treebank(), metavar="PATH",
                    help="treebank.zip or a folder of .mrg files (default: "
                         "$AIAYN_DATA_DIR/ptb-sample/treebank.zip)")
    pr.add_argument("--out", default="runs/parse/data", metavar="DIR", help="output folder")
    pr.add_argument("--dev-fraction", type=float, default=0.1, help="share of files for dev")
    pr.add_argument("--test-fraction", type=float, default=0.1, help="share of files for test")
    from aiayn.parsing.trees import DEFAULT_TARGET_FORM, TARGET_FORMS

    pr.add_argument("--target-form", default=DEFAULT_TARGET_FORM, choices=TARGET_FORMS,
                    help="how trees are written: XX for each word (Vinyals et al.) or the "
                         "words themselves; +labelled-close writes ')NP' for ')' "
                         "(aiayn.parsing.trees.TargetForm; the default scored best on dev); "
                         "kept in split.json for eval")
    pr.add_argument("--min-count", type=int, default=2, metavar="K",
                    help="keep training words seen at least K times as themselves; rarer ones "
                         "are written as unseen words are at test time (--unknown-words); "
                         "2 scored best on dev")
    pr.add_argument("--unknown-words", default="signature", choices=("signature", "unk"),
                    help="what the words under --min-count become in the model's input and "
                         "target: their class by shape and suffix (<UNK-Cap-ing>, as the "
                         "treebank PCFG does; aiayn.parsing.pcfg.WordClasses) or one <unk>; "
                         "with --min-count 1 unseen words are <unk> either way")
    pr.add_argument("--max-files", type=int, default=0, metavar="K",
                    help="use only the first K files (smoke runs); 0: all")
    pr.add_argument("--json", action="store_true", help="print the summary as JSON")

    tr = sub.add_parser("train", formatter_class=_HelpFormatter,
                        help="train a parser on prepared data",
                        description="Train the `parse` preset (N = 2, 60 minutes; beam 21, "
                                    "alpha 0.3, input + 300 when decoding) on the output of "
                                    "`prepare`.")
    tr.add_argument("--data", default="runs/parse/data", metavar="DIR",
                    help="folder written by `aiayn parse prepare`")
    tr.add_argument("--run-dir", default="runs/parse/model", metavar="DIR", help="run folder")
    tr.add_argument("--preset", default="parse", help="preset name or config file")
    tr.add_argument("--minutes", type=float, default=None, metavar="M",
                    help="training minutes (default: the preset's train.time_budget_s)")
    tr.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="override a config field (repeatable)")
    tr.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    tr.add_argument("--device", default=None, help="cpu, cuda or cuda:N")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.add_argument("--json", action="store_true", help="print the summary as JSON")

    ev = sub.add_parser("eval", formatter_class=_HelpFormatter,
                        help="parse a split and score labelled-bracket F1",
                        description="Decode the split with beam search constrained to "
                                    "well-formed trees, score labelled-bracket precision, "
                                    "recall and F1 as EVALB does under COLLINS.prm, and score "
                                    "right-branching and flat baselines on the same sentences "
                                    "(and the treebank PCFG's parses, with --pcfg), labelled "
                                    "and unlabelled.")
    ev.add_argument("checkpoint", metavar="CHECKPOINT", nargs="+",
                    help="a run folder (the model it loads as: its generation record, else "
                         "its averaged, best or newest checkpoint) or a checkpoint folder; "
                         "several make an ensemble (their mean probability; one vocabulary)")
    ev.add_argument("--data", default="runs/parse/data", metavar="DIR",
                    help="folder written by `aiayn parse prepare`")
    ev.add_argument("--split", default="test", choices=("dev", "test"), help="split to parse")
    ev.add_argument("--beam-size", type=int, default=None,
                    help="beam size (default: the run's choice on dev, else the model's "
                         "decode.beam_size, 21)")
    ev.add_argument("--alpha", type=float, default=None,
                    help="length penalty (default: the run's choice on dev, recorded in its "
                         "generation_config.json, else the model's decode.alpha, 0.3)")
    ev.add_argument("--limit", type=int, default=0, metavar="K",
                    help="parse only the first K sentences; 0: all")
    ev.add_argument("--max-words", type=int, default=0, metavar="N",
                    help="score only sentences of at most N words, punctuation included "
                         "(40: EVALB's second figure); 0: all")
    ev.add_argument("--pcfg", default=None, metavar="FILE.jsonl",
                    help="the treebank PCFG's parses of this split (bench/pcfg_baseline.py "
                         "--out); every system is then scored on the sentences it holds")
    ev.add_argument("--no-constraints", action="store_true",
                    help="plain beam search; malformed outputs are then repaired and counted")
    ev.add_argument("--out", default=None, metavar="DIR",
                    help="where SPLIT.parsed and SPLIT.results.json go (default: the run "
                         "the first CHECKPOINT is of: RUN for RUN, RUN/best, RUN/ema, "
                         "RUN/averaged or RUN/checkpoints/step-N)")
    ev.add_argument("--device", default=None, help="cpu, cuda or cuda:N")
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    ev.add_argument("--json", action="store_true", help="print the results as JSON")


def run(args: argparse.Namespace) -> int:
    return {"prepare": _prepare, "train": _train, "eval": _eval}[args.action](args)


def _write_lines(path: Path, lines: list[str]) -> None:
    from aiayn.fileio import write_atomic

    write_atomic(path, "".join(line + "\n" for line in lines))


def word_vocabulary(sources: list[list[str]], targets: list[list[str]], min_count: int = 1):
    """A word-level :class:`~aiayn.data.vocab.Vocabulary`: the specials, every tree token
    (brackets and ``XX``) and every training word seen at least ``min_count`` times (most
    frequent first). Other words become ``<unk>``, in training too when ``min_count`` > 1, so
    the model learns what to do with a word it does not know.

    Raises:
        UserError: ``min_count`` below 1.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    from aiayn.data.vocab import SPECIAL_TOKENS, UNK, Vocabulary
    from aiayn.parsing.trees import PLACEHOLDER, is_close, is_open

    if min_count < 1:
        raise UserError(f"--min-count must be at least 1, got {min_count}")
    tree_tokens = sorted({t for tgt in targets for t in tgt
                          if is_open(t) or is_close(t) or t == PLACEHOLDER})
    words = Counter(w for src in sources for w in src)
    table: dict[str, int] = {}
    for tok in [*SPECIAL_TOKENS, *tree_tokens,
                *(w for w, c in words.most_common() if c >= min_count)]:
        table.setdefault(tok, len(table))
    tokenizer = Tokenizer(models.WordLevel(table, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Vocabulary(tokenizer, kind="word")


def _model_words(train_trees: list, min_count: int, unknown_words: str):
    """word -> the token the model reads and writes for it: itself, or (``unknown_words``
    ``signature``, ``min_count`` > 1) its unknown-word class when seen fewer than
    ``min_count`` times in ``train_trees`` or never; with ``unk`` the word itself, which the
    vocabulary (:func:`word_vocabulary`) turns into ``<unk>``.

    Raises:
        UserError: ``min_count`` below 1.
    """
    from aiayn.parsing.pcfg import WordClasses

    if min_count < 1:
        raise UserError(f"--min-count must be at least 1, got {min_count}")
    if unknown_words == "unk" or min_count == 1:
        return lambda word: word
    try:
        classes = WordClasses.count((t.leaves() for t in train_trees), min_count)
    except ValueError as err:
        raise UserError(str(err)) from None
    return classes.terminal


def _prepare(args: argparse.Namespace) -> int:
    from aiayn.checkpoint import write_json_atomic
    from aiayn.parsing.trees import (
        PLACEHOLDER,
        TargetForm,
        check_fractions,
        clean,
        is_close,
        is_open,
        linearize,
        read_treebank,
        split_by_file,
        to_line,
    )

    if not args.treebank:
        raise UserError("no --treebank given and AIAYN_DATA_DIR is not set")
    check_fractions(args.dev_fraction, args.test_fraction)  # before reading the treebank
    t0 = time.monotonic()
    files = read_treebank(args.treebank, args.max_files)
    split = split_by_file(list(files), args.dev_fraction, args.test_fraction)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    form = TargetForm.from_name(args.target_form)
    summary = {"treebank": str(args.treebank), "target_form": form.name,
               "min_count": args.min_count, "unknown_words": args.unknown_words, "files": {},
               "sentences": {}, "dropped_empty": 0}
    trees = {}
    for name in SPLITS:
        trees[name] = []
        for file_id in split[name]:
            for tree in files[file_id]:
                cleaned = clean(tree)
                if cleaned is None:
                    summary["dropped_empty"] += 1
                else:
                    trees[name].append(cleaned)
    model_word = _model_words(trees["train"], args.min_count, args.unknown_words)
    pairs = {}
    for name in SPLITS:
        src, tgt, gold = [], [], []
        for cleaned in trees[name]:
            words, target = linearize(cleaned, form)
            src.append([model_word(w) for w in words])
            tgt.append([t if is_open(t) or is_close(t) or t == PLACEHOLDER else model_word(t)
                        for t in target])
            gold.append(to_line(cleaned))
        pairs[name] = (src, tgt)
        _write_lines(out / f"{name}.src", [" ".join(s) for s in src])
        _write_lines(out / f"{name}.tgt", [" ".join(t) for t in tgt])
        _write_lines(out / f"{name}.gold", gold)
        summary["files"][name] = split[name]
        summary["sentences"][name] = len(src)
    vocab = word_vocabulary(*pairs["train"], min_count=1 if args.unknown_words ==
                            "signature" else args.min_count)
    vocab.save(out)
    summary["vocabulary"] = len(vocab)
    write_json_atomic(out / "split.json", summary)
    counts = summary["sentences"]
    others = (", the others by class" if args.unknown_words == "signature"
              and args.min_count > 1 else "")
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "files"}))
    else:
        print(f"aiayn parse prepare: {sum(counts.values())} trees from {len(files)} files in "
              f"{time.monotonic() - t0:.1f} s -> {out}")
        for name in SPLITS:
            ids = split[name]
            print(f"  {name:5s} {counts[name]:5d} sentences, {len(ids):3d} files "
                  f"({ids[0]} … {ids[-1]})")
        print(f"  targets in the {form.name} form; word-level vocabulary {len(vocab)} tokens "
              f"(words seen {args.min_count}+ times{others}); "
              f"{summary['dropped_empty']} trees "
              "empty after removing -NONE- dropped")
    return 0


def _train(args: argparse.Namespace) -> int:
    from aiayn.config import load_config
    from aiayn.training.run import run_training

    data = Path(args.data)
    for name in ("train.src", "train.tgt", "dev.src", "dev.tgt", TOKENIZER):
        if not (data / name).is_file():
            raise FileNotFoundError(f"{data / name} is missing: run `aiayn parse prepare "
                                    f"--out {data}` first")
    overrides = [f"data.train_src={data / 'train.src'}", f"data.train_tgt={data / 'train.tgt'}",
                 f"data.valid_src={data / 'dev.src'}", f"data.valid_tgt={data / 'dev.tgt'}",
                 *args.set]
    if args.minutes is not None:
        overrides.append(f"train.time_budget_s={args.minutes * 60}")
    config = None if args.resume else load_config(args.preset, overrides)
    summary = run_training(config, args.run_dir, vocab_path=data, resume=args.resume,
                           overrides=overrides if args.resume else None, device=args.device,
                           progress=not args.no_progress,
                           log=lambda msg: None if args.json else print(msg, flush=True))
    if args.json:
        print(json.dumps(summary))
    else:
        print("aiayn parse train: " + ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
    return 0


def target_form_of(data: Path):
    """The :class:`~aiayn.parsing.trees.TargetForm` a prepared data folder was written in
    (its ``split.json``; ``xx`` for folders written before there was a choice).

    Raises:
        UserError: a ``split.json`` that is not JSON or names an unknown form (file named).
    """
    from aiayn.parsing.trees import TargetForm

    path = data / "split.json"
    if not path.is_file():
        return TargetForm()
    try:
        return TargetForm.from_name(json.loads(path.read_text(encoding="utf-8"))
                                    .get("target_form", "xx"))
    except (ValueError, AttributeError) as err:
        raise UserError(f"{path}: {err}") from None


def _read_pcfg(path: Path, sentences: list[list[str]], split: str) -> dict:
    """index -> tree of a bench/pcfg_baseline.py output file
    (:func:`aiayn.parsing.pcfg.read_parses`).

    Raises:
        UserError: a missing file, one of another split, or a bad record (file and line named).
    """
    from nltk.tree import Tree

    from aiayn.parsing.pcfg import read_parses

    if not path.is_file():
        raise UserError(f"--pcfg: no file {path}")
    try:
        settings, records = read_parses(path, sentences)
    except ValueError as err:
        raise UserError(str(err)) from None
    if settings.get("split", split) != split:
        raise UserError(f"{path}: parses of the {settings['split']} split, not {split}")
    return {i: Tree.fromstring(rec["tree"]) for i, rec in records.items()}


def _default_out(path: Path) -> Path:
    """Where ``parse eval`` writes without ``--out``: the run the model is of
    (:meth:`aiayn.rundir.RunDir.of`: ``RUN`` for ``RUN``, ``RUN/best``, ``RUN/ema``,
    ``RUN/averaged`` or a step checkpoint); beside a checkpoint that is no run's; else the
    folder given."""
    from aiayn.rundir import RunDir, is_checkpoint

    run = RunDir.of(path)
    if run is not None:
        return run.path
    folder = path.parent if path.is_file() else path
    return folder.parent if is_checkpoint(folder) else folder


def _eval(args: argparse.Namespace) -> int:
    from nltk.tree import Tree

    from aiayn.checkpoint import write_json_atomic
    from aiayn.data.corpus import read_lines as read_text_lines
    from aiayn.parsing.decode import parse, teacher_forced_accuracy
    from aiayn.parsing.evalb import score_corpus
    from aiayn.parsing.trees import (canonical, delinearize, flat, is_well_formed, linearize,
                                     repair, right_branching, to_line)

    data = Path(args.data)
    src_path, gold_path = data / f"{args.split}.src", data / f"{args.split}.gold"
    for path in (src_path, gold_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: run `aiayn parse prepare --out {data}`")
    sentences = [line.split() for line in read_text_lines(src_path)]
    form = target_form_of(data)
    golds = []
    for i, line in enumerate(read_text_lines(gold_path), 1):
        try:
            golds.append(Tree.fromstring(line))
        except ValueError as err:
            raise UserError(f"{gold_path}, line {i}: not a tree ({err})") from None
    if len(golds) != len(sentences):
        raise UserError(f"{src_path} has {len(sentences)} lines but {gold_path} {len(golds)}")
    # SPLIT.src is what the model reads (rare words as their class); trees hold the words
    words_of = [g.leaves() for g in golds]
    for i, (src, words) in enumerate(zip(sentences, words_of), 1):
        if len(src) != len(words):
            raise UserError(f"{src_path}, line {i}: {len(src)} words, but the tree on line "
                            f"{i} of {gold_path} has {len(words)}")
    keep = list(range(len(sentences)))
    if args.max_words:
        keep = [i for i in keep if len(sentences[i]) <= args.max_words]
    pcfg_trees = _read_pcfg(Path(args.pcfg), words_of, args.split) if args.pcfg else None
    if pcfg_trees is not None:
        keep = [i for i in keep if i in pcfg_trees]
    if args.limit:
        keep = keep[: args.limit]
    if not keep:
        raise UserError(f"no {args.split} sentence left to score (--max-words, --pcfg, --limit)")
    sentences, golds = [sentences[i] for i in keep], [golds[i] for i in keep]
    words_of = [words_of[i] for i in keep]
    from aiayn.pretrained import load_pretrained

    def say(msg: str) -> None:
        print(f"aiayn parse eval: {msg}", file=sys.stderr)

    # the one loader: the run's model, with the search settings it chose (generation record)
    loaded = load_pretrained(args.checkpoint, args.device or "cpu", say)
    models, config, vocab, folders = loaded.models, loaded.config, loaded.vocab, loaded.sources
    tgt_path = data / f"{args.split}.tgt"
    accuracy = None
    if tgt_path.is_file():  # teacher-forced token accuracy: learned the language at all?
        gold_targets = [line.split() for line in read_text_lines(tgt_path)]
        accuracy = teacher_forced_accuracy(models, vocab, sentences,
                                           [gold_targets[i] for i in keep],
                                           batch_size=config.decode.batch_size)
    beam = args.beam_size or config.decode.beam_size
    alpha = config.decode.alpha if args.alpha is None else args.alpha
    t0 = time.monotonic()
    targets = parse(models, vocab, sentences, beam_size=beam, alpha=alpha,
                    max_len_b=config.decode.max_len_b, batch_size=config.decode.batch_size,
                    constrained=not args.no_constraints, form=form,
                    progress=not args.no_progress and not args.json)
    decode_s = time.monotonic() - t0
    repaired, tests = 0, []
    for words, target in zip(words_of, targets):
        target, matched = canonical(target, form)
        if not (matched and is_well_formed(target, len(words))):
            target = repair(target, len(words))
            repaired += 1
        tests.append(delinearize(target, words))
    systems = {"model": tests, "right_branching": [right_branching(w) for w in words_of],
               "flat": [flat(w) for w in words_of]}
    if pcfg_trees is not None:
        systems["pcfg"] = [pcfg_trees[i] for i in keep]
    scores = {name: score_corpus(golds, trees) for name, trees in systems.items()}
    unlabelled = {name: score_corpus(golds, trees, labeled=False)
                  for name, trees in systems.items()}
    # the check that tells a bug from too little data: gold trees through the model's
    # target form and back score 100
    round_trip = score_corpus(golds, [delinearize(canonical(linearize(g, form)[1], form)[0], w)
                                      for g, w in zip(golds, words_of)])
    labels = Counter(t.label() for g in golds for t in g.subtrees() if not isinstance(t[0], str))
    out = Path(args.out) if args.out else _default_out(Path(args.checkpoint[0]))
    out.mkdir(parents=True, exist_ok=True)
    _write_lines(out / f"{args.split}.parsed", [to_line(t) for t in tests])
    results = {
        "split": args.split, "sentences": len(sentences), "target_form": form.name,
        "checkpoints": [str(c) for c in args.checkpoint],
        "model_folders": folders,  # what they load as (model_paths)
        "beam_size": beam, "alpha": alpha,
        "max_len": f"input + {config.decode.max_len_b}", "constrained": not args.no_constraints,
        "repaired": repaired, "decode_wall_s": round(decode_s, 1),
        "max_words": args.max_words or None, "pcfg_file": args.pcfg,
        **{name: sc.to_dict() for name, sc in scores.items()},
        "unlabelled": {name: sc.to_dict() for name, sc in unlabelled.items()},
        "gold_round_trip_f1": round_trip.f1,
        "teacher_forced_accuracy": None if accuracy is None else round(accuracy, 2),
        "scorer": "EVALB-compatible (COLLINS.prm rules), brackets read with PYEVALB",
        "gold_label_counts": dict(labels.most_common(5)),
    }
    write_json_atomic(out / f"{args.split}.results.json", results)
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"aiayn parse eval: {len(sentences)} {args.split} sentences ({form.name} targets), "
          f"beam {beam}, alpha "
          f"{alpha}, {'constrained' if not args.no_constraints else 'unconstrained'} decoding "
          f"in {decode_s:.0f} s; {repaired} output(s) repaired")
    names = {"model": "model", "right_branching": "right-branching baseline",
             "flat": "flat baseline (one bracket)",
             "pcfg": "treebank PCFG (nltk; parent annot., Markov 1)"}
    print("  EVALB, COLLINS.prm          labelled: precision  recall     F1   unlabelled F1")
    for name, sc in scores.items():
        print(f"  {names[name]:45s} {sc.precision:8.2f} {sc.recall:7.2f} {sc.f1:7.2f} "
              f"{unlabelled[name].f1:9.2f}")
    print(f"  check: gold trees linearized and read back score F1 {round_trip.f1:.2f}")
    if accuracy is not None:
        print(f"  check: teacher-forced token accuracy {accuracy:.2f}% (the gold prefix given)")
    print(f"  wrote {out / (args.split + '.parsed')} and {out / (args.split + '.results.json')}")
    return 0
