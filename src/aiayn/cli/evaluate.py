"""``aiayn evaluate``: BLEU and chrF of a checkpoint's translations (or of an existing output
file), each score labelled with its protocol (see :mod:`aiayn.evaluation.bleu`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from aiayn.cli.translate import add_decode_arguments

HELP = ("Score translations: sacreBLEU BLEU and chrF (with signatures), the paper's tokenized "
        "BLEU, and optionally the Multi30k literature's protocol.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_decode_arguments(p, checkpoint_required=False)
    p.add_argument("--src", metavar="FILE", help="source sentences to translate (needs "
                   "--checkpoint)")
    p.add_argument("--hyp", metavar="FILE", help="score this existing output instead of "
                   "translating")
    p.add_argument("--ref", metavar="FILE", help="detokenized references, line-aligned (.gz ok)")
    p.add_argument("--ref-tok", metavar="FILE",
                   help="references tokenized in the Multi30k protocol (e.g. multi30k/tok/"
                        "test_2016_flickr.lc.norm.tok.de.gz): adds the Multi30k-protocol BLEU")
    p.add_argument("--pretokenized", action="store_true",
                   help="--hyp is already lowercased, normalized and Moses-tokenized (the output "
                        "of a data.preprocess = lc-norm-tok model): score it as it is against "
                        "--ref-tok (with --src, the checkpoint decides this)")
    p.add_argument("--lang", default=None,
                   help="target language for Moses tokenization (default: the checkpoint's "
                        "data.tgt_lang, else 'de')")
    p.add_argument("--output", metavar="FILE", help="also write the translations here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from aiayn.errors import UserError
    from aiayn.evaluation.bleu import (
        PROTOCOLS,
        multi30k_tok_bleu,
        paper_tok_bleu,
        read_lines,
        sacrebleu_scores,
    )

    if (args.hyp is None) == (args.src is None):
        raise UserError("give either --src FILE with --checkpoint (translate, then score) or "
                        "--hyp FILE (score an existing output)")
    if args.src is not None and args.checkpoint is None:
        raise UserError("--src needs --checkpoint PATH to translate with")
    if args.ref is None and args.ref_tok is None:
        raise UserError("give --ref FILE (detokenized references) and/or --ref-tok FILE")
    from aiayn.cli.translate import check_decode_arguments
    from aiayn.fileio import atomic_file, check_output_file

    check_decode_arguments(args)
    if args.output:
        check_output_file(args.output, "--output")
    lang = args.lang
    result: dict = {}
    pretokenized = args.pretokenized
    if args.src is not None and pretokenized:
        raise UserError("--pretokenized is for --hyp; with --src the checkpoint's "
                        "data.preprocess decides how its output is scored")
    if args.hyp is not None:
        hyps = read_lines(args.hyp)
        if not hyps:
            raise UserError(f"--hyp {args.hyp}: the file is empty, nothing to score")
        result["hyp"] = args.hyp
    else:
        from aiayn.cli.translate import decode_options, load_translator
        from aiayn.decoding.guards import GUARD_FIELDS
        from aiayn.data.text import is_protocol_text

        lines = read_lines(args.src)
        if not lines:
            raise UserError(f"--src {args.src}: the file is empty, nothing to translate")
        translator = load_translator(args, "evaluate")
        config = translator.config
        # the model reads and writes the text it was trained on (data.preprocess)
        pretokenized = is_protocol_text(config.data.preprocess)
        options = decode_options(args)
        translations = translator.generate(lines, progress=not args.quiet and
                                           sys.stderr.isatty(), **options)
        hyps = [t[0].text for t in translations]
        lang = lang or config.data.tgt_lang
        decode = translator.decode_settings(**{k: options[k] for k in (
            "beam_size", "alpha", "max_len_a", "max_len_b", "batch_size", *GUARD_FIELDS)
            if k in options})
        result.update(checkpoint=args.checkpoint[0], src=args.src,
                      decode={**dataclasses.asdict(decode), "nbest": 1,
                              "bf16": translator.precision.uses_bf16,
                              "precision": translator.precision.chosen,
                              "long_inputs": options["long_inputs"]},
                      sampling=options["sampling"] is not None)
        if len(args.checkpoint) > 1:
            result["ensemble"] = args.checkpoint
        if args.output:
            with atomic_file(args.output, "w") as f:
                f.writelines(h.replace("\n", " ") + "\n" for h in hyps)
    lang = lang or "de"
    result.update(lang=lang, sentences=len(hyps))
    if pretokenized and args.ref_tok is None:
        raise UserError("these translations are lowercased and Moses-tokenized "
                        "(data.preprocess = lc-norm-tok): give --ref-tok FILE (e.g. multi30k/tok/"
                        "val.lc.norm.tok.de.gz) to score them in the Multi30k protocol")
    if pretokenized and args.ref is not None:
        print(f"aiayn evaluate: --ref {args.ref} not scored: lowercased, tokenized output "
              "against cased, detokenized references would measure the casing, not the "
              "translation", file=sys.stderr)
    scores = {}
    if args.ref is not None and not pretokenized:  # cased, detokenized text only
        refs = read_lines(args.ref)
        s = sacrebleu_scores(hyps, refs)
        scores["sacrebleu"] = {"protocol": PROTOCOLS["sacrebleu"], **s}
        scores["paper"] = {"protocol": PROTOCOLS["paper"],
                           "bleu": paper_tok_bleu(hyps, refs, lang)}
    if args.ref_tok is not None:
        scores["multi30k"] = {"protocol": PROTOCOLS["multi30k"],
                              "bleu": multi30k_tok_bleu(hyps, args.ref_tok, lang,
                                                      pretokenized=pretokenized)}
    result["scores"] = scores
    result["text"] = "lc-norm-tok" if pretokenized else "none"
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
        return 0
    print(f"{len(hyps)} sentences, target language {lang}")
    if "sacrebleu" in scores:
        s = scores["sacrebleu"]
        print(f"BLEU  {s['bleu']:6.2f}  sacreBLEU, detokenized   {s['bleu_signature']}")
        print(f"chrF  {s['chrf']:6.2f}  sacreBLEU, detokenized   {s['chrf_signature']}")
        print(f"BLEU  {scores['paper']['bleu']:6.2f}  paper-style tokenized   "
              f"(Moses{', ##AT## compounds' if lang == 'de' else ''}; compare with Table 2)")
    if "multi30k" in scores:
        print(f"BLEU  {scores['multi30k']['bleu']:6.2f}  Multi30k protocol        "
              "(lowercased, Moses-normalized+tokenized, tok:none)")
    return 0
