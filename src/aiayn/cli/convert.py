"""``aiayn convert``: import a Hugging Face Marian (OPUS-MT) model, or export a checkpoint to
Hugging Face or CTranslate2."""

from __future__ import annotations

import argparse
import json
import sys

HELP = ("Convert models: --from hf DIR -o CHECKPOINT imports a Hugging Face Marian (OPUS-MT) "
        "directory; --to hf|ctranslate2 CHECKPOINT -o DIR exports one.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    direction = p.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from", dest="from_format", choices=["hf"],
                           help="import: the input is a Hugging Face MarianMTModel directory "
                                "(config.json, model.safetensors or pytorch_model.bin, "
                                "source.spm, target.spm, vocab.json)")
    direction.add_argument("--to", dest="to_format", choices=["hf", "ctranslate2"],
                           help="export: the input is an aiayn checkpoint, or a run directory "
                                "(the model it loads as: the members and search settings "
                                "its pipeline chose on val, else its averaged, best or newest "
                                "checkpoint)")
    p.add_argument("input", metavar="PATH", help="the model to convert")
    p.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="where to write (an existing directory there is replaced)")
    p.add_argument("--quantization", default=None,
                   help="with --to ctranslate2: CTranslate2 weight type (int8, int8_float32, "
                        "bfloat16, ...); default: fp32 as stored")
    p.add_argument("--vmap", default=None, metavar="FILE",
                   help="with --to ctranslate2: a vocabulary shortlist (`aiayn shortlist`) "
                        "to include, for CTranslate2's use_vmap=True")
    p.add_argument("--json", action="store_true", help="print a JSON summary")


def run(args: argparse.Namespace) -> int:
    from aiayn.checkpoint import save_checkpoint
    from aiayn.errors import UserError
    from aiayn.pretrained import load_pretrained

    if args.quantization and args.to_format != "ctranslate2":
        raise UserError("--quantization applies to --to ctranslate2 only")
    if args.vmap and args.to_format != "ctranslate2":
        raise UserError("--vmap applies to --to ctranslate2 only")
    if args.from_format == "hf":
        from aiayn.interop.marian import import_hf

        model, config, vocab = import_hf(args.input)
        save_checkpoint(args.output, model, config, vocab, meta={"converted_from": str(
            args.input), "format": "hf-marian"})
    else:  # the one loader: the run's chosen search settings travel with the model
        loaded = load_pretrained(args.input, "cpu",
                                 lambda msg: print(msg, file=sys.stderr))
        paths = loaded.sources
        if len(paths) > 1:
            raise UserError(f"{args.input}: an ensemble of {len(paths)} models "
                            f"({', '.join(paths)}); export one member's folder")
        model, config, vocab = loaded.models[0], loaded.config, loaded.vocab
        try:
            if args.to_format == "hf":
                from aiayn.interop.marian import export_hf

                export_hf(model, config, vocab, args.output)
            else:
                from aiayn.interop.ctranslate2 import export_ctranslate2

                export_ctranslate2(model, config, vocab, args.output, args.quantization,
                                   args.vmap)
        except UserError as err:
            raise UserError(f"{args.input}: {err}") from None
    summary = {"input": args.input, "output": args.output,
               "checkpoint": None if args.from_format else paths[0],
               "from": args.from_format or "aiayn", "to": args.to_format or "aiayn",
               "N": config.model.N, "d_model": config.model.d_model,
               "vocab_size": config.model.vocab_size,
               "tgt_vocab_size": config.model.target_vocab_size}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"aiayn convert: wrote {args.output} ({summary['from']} -> {summary['to']}, "
              f"N={config.model.N}, d_model={config.model.d_model}, "
              f"vocabulary {config.model.vocab_size}/{config.model.target_vocab_size})",
              file=sys.stderr)
    return 0
