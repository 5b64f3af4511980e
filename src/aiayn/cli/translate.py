"""``aiayn translate``: translate a file or standard input line by line with a checkpoint."""

from __future__ import annotations

import argparse
import json
import sys

from aiayn.errors import UserError
from aiayn.precision import DECODE_PRECISIONS
from aiayn.rundir import GENERATION_CONFIG

HELP = ("Translate text line by line with a checkpoint (beam search as §6.1 by default); one "
        "output line per input line.")


def add_decode_arguments(p: argparse.ArgumentParser, checkpoint_required: bool = True) -> None:
    """Options shared by ``translate`` and ``evaluate`` (defaults: the checkpoint's config)."""
    p.add_argument("--checkpoint", required=checkpoint_required, nargs="+", metavar="PATH",
                   help="checkpoint directory; or a run directory: the model its pipeline "
                        "chose on the validation set (members, averaging, alpha: "
                        f"RUN/{GENERATION_CONFIG}), else its averaged, best or newest "
                        "checkpoint (a checkpoint the run keeps, RUN/best or "
                        "RUN/checkpoints/step-N, decodes with the run's chosen search "
                        "settings too); or a Hugging Face Marian directory. Several make an "
                        "ensemble, whose next-token probabilities are averaged (one "
                        "vocabulary); the first one's settings give the decoding defaults")
    p.add_argument("--beam", type=int, default=None, metavar="K",
                   help="beam size; 1 = greedy (default: the checkpoint's decode.beam_size, "
                        "4 as in §6.1)")
    p.add_argument("--alpha", type=float, default=None,
                   help="length penalty ((5+|Y|)/6)^alpha (default: decode.alpha, 0.6)")
    p.add_argument("--max-len-a", type=float, default=None, metavar="A",
                   help="max output tokens = A * input tokens + B (default: decode, 1.0)")
    p.add_argument("--max-len-b", type=int, default=None, metavar="B",
                   help="see --max-len-a (default: decode.max_len_b, 50)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="sentences decoded together (default: decode.batch_size)")
    p.add_argument("--sample", action="store_true",
                   help="sample instead of searching (with --temperature, --top-k, --top-p)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="with --sample: divide the logits by this (<1 sharper, >1 flatter)")
    p.add_argument("--top-k", type=int, default=0, help="0: no top-k filter")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0: no nucleus filter")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--reject-long", action="store_true",
                   help="fail on an input line longer than the model's max_len instead of "
                        "truncating it with a warning")
    p.add_argument("--device", default=None,
                   help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--precision", choices=DECODE_PRECISIONS, default=None,
                   help="fp32 (the reference); bf16 (autocast); int8 (int8 weights and "
                        "per-row int8 activations, CPU); auto: int8 where a short probe finds "
                        "it faster than fp32 on this machine, else bf16 where that is "
                        "(default: what a finished run "
                        "recorded, int8 where it kept val BLEU within 0.2 of fp32; else fp32)")
    p.add_argument("--bf16", dest="precision", action="store_const", const="bf16",
                   help="the same as --precision bf16")
    p.add_argument("--shortlist", default=None, metavar="VMAP",
                   help="a vocabulary shortlist (`aiayn shortlist`; CTranslate2's vmap "
                        "format): each sentence produces only the target tokens its source "
                        "tokens list, plus the most frequent ones. Faster; changes outputs "
                        "(off by default)")
    p.add_argument("--workers", type=workers_value, default="auto", metavar="N",
                   help="decode in N one-thread processes over the one model, each taking "
                        "every N-th batch (the same output); auto: one per torch thread on "
                        "CPU, except with --sample (default: auto)")


def workers_value(text: str) -> int | str:
    """``--workers``: "auto" or a count >= 1."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a count >= 1, got {text!r}")
    return value


_DECODE_OPTIONS = {"beam_size": "--beam", "alpha": "--alpha", "max_len_a": "--max-len-a",
                   "max_len_b": "--max-len-b", "batch_size": "--batch-size"}


def check_decode_arguments(args: argparse.Namespace) -> None:
    """Put the decoding options given on the command line through the checks of
    :class:`~aiayn.config.DecodeConfig` and :class:`~aiayn.decoding.SamplingConfig`, before
    any file is read or model loaded.

    Raises:
        ValueError: naming the option and its value.
    """
    from aiayn.config import DecodeConfig
    from aiayn.decoding import SamplingConfig

    given = {field: getattr(args, option[2:].replace("-", "_"))
             for field, option in _DECODE_OPTIONS.items()}
    given["beam_size"] = args.beam
    try:
        DecodeConfig(**{k: v for k, v in given.items() if v is not None})
    except ValueError as err:
        text = str(err)
        for field, option in _DECODE_OPTIONS.items():
            text = text.replace(f"DecodeConfig.{field}", option)
        raise UserError(text) from None
    if args.sample:
        try:
            SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)
        except ValueError as err:
            raise UserError(f"--{err}") from None


def decode_options(args: argparse.Namespace, nbest: int = 1) -> dict:
    """Keyword arguments for :meth:`aiayn.Translator.generate` from the CLI options; what was
    not given stays None, so the model's own decode defaults fill it."""
    from aiayn.decoding import SamplingConfig

    sampling = None
    if args.sample:
        sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)
    return dict(beam_size=args.beam, alpha=args.alpha, max_len_a=args.max_len_a,
                max_len_b=args.max_len_b, batch_size=args.batch_size, nbest=nbest,
                sampling=sampling, long_inputs="error" if args.reject_long else "truncate")


def load_translator(args: argparse.Namespace, command: str):
    """The :class:`aiayn.Translator` of ``--checkpoint`` (one path or an ensemble's), on
    ``--device`` at ``--precision``; what loading has to say goes to stderr.

    Raises:
        UserError: see :meth:`aiayn.Translator.from_pretrained`.
    """
    from aiayn.translator import Translator

    return Translator.from_pretrained(args.checkpoint, device=args.device,
                                      precision=args.precision, warn=warner(command),
                                      workers=getattr(args, "workers", 1),
                                      shortlist=getattr(args, "shortlist", None))


def read_input(path: str | None) -> list[str]:
    """Lines of ``path`` (``-`` or None: standard input), checked to be UTF-8."""
    from aiayn.evaluation.bleu import decode_lines, read_lines

    if path in (None, "-"):
        return decode_lines(sys.stdin.buffer.read(), "<stdin>")
    return read_lines(path)


def warner(command: str):
    return lambda msg: print(f"aiayn {command}: warning: {msg}", file=sys.stderr)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--input", default=None, metavar="FILE",
                   help="UTF-8 text, one sentence per line (.gz ok); default: standard input")
    p.add_argument("-o", "--output", default=None, metavar="FILE",
                   help="where to write (a progress bar shows); default: standard output")
    add_decode_arguments(p)
    p.add_argument("--nbest", type=int, default=1, metavar="K",
                   help="K translations per line (needs beam search); as text, K lines "
                        "'LINE ||| translation ||| score' per input line (LINE counts from 0)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per input line: line number, translations with "
                        "text, score and log_prob")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _one_line(text: str) -> str:
    # a stray newline in a translation would break line alignment
    return text.replace("\r", " ").replace("\n", " ")


def run(args: argparse.Namespace) -> int:
    from aiayn.devices import choose_device
    from aiayn.fileio import atomic_file, check_output_file

    if args.nbest < 1:
        raise UserError(f"--nbest must be >= 1, got {args.nbest}")
    check_decode_arguments(args)
    choose_device(args.device)
    to_file = args.output not in (None, "-")
    if to_file:  # before the whole input is decoded, not after
        check_output_file(args.output)
    lines = read_input(args.input)
    translator = load_translator(args, "translate")
    results = translator.generate(lines, progress=args.output is not None and not args.quiet,
                                  **decode_options(args, nbest=args.nbest))
    out = []
    for n, translations in enumerate(results):
        if args.json:
            out.append(json.dumps({"line": n + 1, "translations": [
                {"text": t.text, "score": t.score, "log_prob": t.log_prob}
                for t in translations]}, ensure_ascii=False))
        elif args.nbest > 1:
            out.extend(f"{n} ||| {_one_line(t.text)} ||| {t.score:.4f}" for t in translations)
        else:
            out.append(_one_line(translations[0].text))
    data = "".join(line + "\n" for line in out).encode("utf-8")
    if not to_file:
        sys.stdout.buffer.write(data) if hasattr(sys.stdout, "buffer") else \
            sys.stdout.write(data.decode("utf-8"))
        sys.stdout.flush()
    else:
        with atomic_file(args.output) as f:
            f.write(data)
    return 0
