"""``aiayn translate``: translate a file or standard input line by line with a checkpoint, or
a document (``--document``: paragraphs cut into sentences and put back, :mod:`aiayn.data.segment`).
A line longer than the model's ``max_len`` is translated in parts and joined, and stderr says
which (``--reject-long``: an error instead)."""

from __future__ import annotations

import argparse
import json
import sys

from aiayn.errors import UserError
from aiayn.precision import DECODE_PRECISIONS
from aiayn.rundir import GENERATION_CONFIG

HELP = ("Translate text line by line with a checkpoint (beam search as §6.1 by default); one "
        "output line per input line; or a document of paragraphs (--document).")


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
    p.add_argument("--no-repeat-ngram-size", type=int, default=None, metavar="N",
                   help="guard: no N consecutive output tokens appear twice (CTranslate2's "
                        "no_repeat_ngram_size; default: decode.no_repeat_ngram_size, 0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=None, metavar="P",
                   help="guard: a token generated before has its log-probability multiplied "
                        "by P; > 1 penalizes repeats (default: decode.repetition_penalty, "
                        "1 = off)")
    p.add_argument("--min-length-ratio", type=float, default=None, metavar="R",
                   help="guard: no end of sentence before R * input tokens (default: "
                        "decode.min_length_ratio, 0 = off)")
    p.add_argument("--max-length-ratio", type=float, default=None, metavar="R",
                   help="guard: at most R * input tokens, then the end of sentence is forced; "
                        "caps --max-len-a/--max-len-b (Marian's --max-length-factor; default: "
                        "decode.max_length_ratio, off)")
    p.add_argument("--reject-long", action="store_true",
                   help="fail on an input line longer than the model's max_len instead of "
                        "translating it in parts (cut at sentence ends, then ; :, then commas, "
                        "then a window of words) and joining them, with a note on stderr")
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
                   "max_len_b": "--max-len-b", "batch_size": "--batch-size",
                   # the guards (aiayn.decoding.guards.GUARD_FIELDS)
                   "no_repeat_ngram_size": "--no-repeat-ngram-size",
                   "repetition_penalty": "--repetition-penalty",
                   "min_length_ratio": "--min-length-ratio",
                   "max_length_ratio": "--max-length-ratio"}


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
    from aiayn.decoding.guards import GUARD_FIELDS

    guards = {name: getattr(args, name) for name in GUARD_FIELDS
              if getattr(args, name, None) is not None}
    return dict(beam_size=args.beam, alpha=args.alpha, max_len_a=args.max_len_a,
                max_len_b=args.max_len_b, batch_size=args.batch_size, nbest=nbest,
                sampling=sampling, long_inputs="error" if args.reject_long else "split",
                **guards)


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

    from pathlib import Path

    if path in (None, "-"):
        data = sys.stdin.buffer.read()
        refuse_binary(data, "<stdin>")
        return decode_lines(data, "<stdin>")
    if Path(path).suffix != ".gz" and Path(path).is_file():  # else read_lines says what is wrong
        with open(path, "rb") as f:
            refuse_binary(f.read(8192), path)  # the first 8 KiB, as git and grep judge
    return read_lines(path)


def refuse_binary(data: bytes, name: str) -> None:
    """Refuse the input's bytes (or their start) if they hold a NUL byte: valid UTF-8, but
    no text; a binary file given by mistake (a weights file, an archive).

    Raises:
        DataError: naming ``name`` and the NUL's byte offset.
    """
    from aiayn.errors import DataError

    nul = data.find(b"\x00")
    if nul >= 0:
        raise DataError(f"{name}: a binary file, not text (a NUL byte at byte {nul}); "
                        "translate reads UTF-8 text")


def read_document(path: str | None) -> str:
    """The whole text of ``path`` (``-`` or None: standard input; ``.gz`` read transparently),
    exactly as written (line ends, blank lines and surrounding whitespace kept).

    Raises:
        FileNotFoundError: no such file.
        UserError: an empty file (0 bytes).
        DataError: a folder, a broken gzip stream, a binary file (a NUL byte) or text that is
            not UTF-8 (naming the line).
    """
    import gzip
    import zlib
    from pathlib import Path

    from aiayn.errors import DataError

    name = "<stdin>" if path in (None, "-") else path
    if path in (None, "-"):
        data = sys.stdin.buffer.read()
    else:
        file = Path(path)
        if file.is_dir():
            raise DataError(f"{file}: is a directory, not a text file")
        if not file.is_file():
            raise FileNotFoundError(f"file not found: {file}")
        try:
            data = gzip.open(file).read() if file.suffix == ".gz" else file.read_bytes()
        except (OSError, EOFError, zlib.error) as err:
            raise DataError(f"{file}: read failed ({err})") from None
    if not data:
        raise UserError(f"{name}: the document is empty (0 bytes), nothing to translate")
    refuse_binary(data, name)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise DataError(f"{name}, line {line}: invalid UTF-8 ({err.reason}); translate reads "
                        "UTF-8 text") from None


def warner(command: str):
    return lambda msg: print(f"aiayn {command}: warning: {msg}", file=sys.stderr)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--input", default=None, metavar="FILE",
                   help="UTF-8 text, one sentence per line (.gz ok); with --document, "
                        "paragraphs; default: standard input")
    p.add_argument("-o", "--output", default=None, metavar="FILE",
                   help="where to write (a progress bar shows); default: standard output")
    add_decode_arguments(p)
    p.add_argument("--nbest", type=int, default=1, metavar="K",
                   help="K translations per line (needs beam search); as text, K lines "
                        "'LINE ||| translation ||| score' per input line (LINE counts from 0)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per input line: line number, parts (1: it fit the "
                        "model; more: translated in parts), translations with text, score, "
                        "log_prob, confidence (log_prob per token), flags (likely failures: "
                        "repeat, length_ratio, copy, no_eos) and unchecked flags; with "
                        "--document, one object: the text and each sentence")
    p.add_argument("--document", action="store_true",
                   help="the input is a document: paragraphs separated by blank lines, each "
                        "cut into sentences (with the source language's abbreviations), all "
                        "translated as one batch and put back with every line break, blank "
                        "line and surrounding space kept; one sentence a line stays so")
    p.add_argument("--lang", default=None, metavar="CODE",
                   help="the source language for cutting sentences (ISO 639, e.g. en; "
                        "default: the model's data.src_lang)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--target-prefix", default=None, metavar="FILE",
                   help="UTF-8 text, line-aligned with the input: each translation begins "
                        "with its line's text exactly (an empty line: none) and the search "
                        "continues from there")
    p.add_argument("--alternatives", action="store_true",
                   help="with --nbest K: the K most likely tokens after each prefix (or at "
                        "the start), each continued by the search, in that order "
                        "(CTranslate2's return_alternatives, for autocompletion); K may "
                        "exceed --beam")
    p.add_argument("--markup", action="store_true",
                   help="carry inline tags (<b>...</b>, <br/>) and placeholders ({name}, %%s, "
                        "%%d, URLs, e-mail addresses, numbers) through translation: taken out, "
                        "put back at the aligned words, well-formed; unbalanced tags are kept "
                        "as written, with a note on stderr")
    p.add_argument("--placeholder", action="append", default=None, metavar="REGEX",
                   help="with --markup: also keep text matching this Python regular "
                        "expression as it is (repeatable); 'none': not the default patterns")
    p.add_argument("--constraints", default=None, metavar="FILE",
                   help="terminology constraints, line-aligned with the input: target phrases "
                        "separated by tabs (an empty line for none), or JSON Lines "
                        '{"constraints": ["phrase", ...]}; each translation holds its '
                        "line's phrases (dynamic beam allocation; lines without any decode "
                        "as before)")
    p.add_argument("--glossary", default=None, metavar="FILE",
                   help="'source term<TAB>target term' per line: where a source term occurs "
                        "in a line (whole words), its target term becomes a constraint")
    p.add_argument("--alignments", action="store_true",
                   help="word alignments of each translation to its source, in Pharaoh format "
                        "(source-target word pairs, 0-based: '0-0 1-2'), from one "
                        "cross-attention layer (aiayn.decoding.alignment): as text "
                        "'translation ||| 0-0 1-2' (with --nbest, a fourth field); with --json, "
                        "an 'alignment' key")


def _one_line(text: str) -> str:
    # a stray newline in a translation would break line alignment
    return text.replace("\r", " ").replace("\n", " ")


def run(args: argparse.Namespace) -> int:
    from aiayn.decoding.quality import to_json as quality_json
    from aiayn.devices import choose_device
    from aiayn.fileio import check_output_file

    if args.nbest < 1:
        raise UserError(f"--nbest must be >= 1, got {args.nbest}")
    if args.document and args.nbest > 1:
        raise UserError(f"--nbest {args.nbest} needs one sentence a line; --document gives "
                        "one translated document")
    if args.document and (args.target_prefix or args.alternatives):
        raise UserError("--target-prefix and --alternatives need one sentence a line, not "
                        "--document")
    if args.document and args.alignments:
        raise UserError("--alignments needs one sentence a line; --document gives one "
                        "translated document")
    check_decode_arguments(args)
    markup = markup_settings(args)
    choose_device(args.device)
    to_file = args.output not in (None, "-")
    if to_file:  # before the whole input is decoded, not after
        check_output_file(args.output)
    progress = args.output is not None and not args.quiet
    if args.document and (args.constraints or args.glossary):
        raise UserError("--constraints and --glossary need one sentence a line; --document "
                        "cuts paragraphs into sentences itself")
    if args.document:
        data = _translate_document(args, read_document(args.input), progress)
        _write(data, args.output if to_file else None)
        return 0
    lines = read_input(args.input)
    prefixes = read_prefixes(args, len(lines))
    constraints = None
    if args.constraints or args.glossary:  # read before the model loads
        from aiayn.decoding import constraints as c

        constraints = c.merge_constraints(
            c.read_constraints(args.constraints, len(lines)) if args.constraints else None,
            c.glossary_constraints(c.read_glossary(args.glossary), lines) if args.glossary
            else None)
    translator = load_translator(args, "translate")
    options = decode_options(args, nbest=args.nbest)
    if prefixes is not None or args.alternatives:
        options.update(target_prefix=prefixes, alternatives=args.alternatives)
    if markup is not None:
        options["markup"] = markup
    if constraints is not None:
        options["constraints"] = constraints
    if args.alignments:
        options["alignments"] = True
    parts = [1] * len(lines)
    if options["long_inputs"] == "split":
        del options["long_inputs"]
        result = translator.generate_text(lines, lang=args.lang, progress=progress, **options)
        results, parts = result.translations, result.parts
    else:
        results = translator.generate(lines, progress=progress, **options)
    out = []
    for n, translations in enumerate(results):
        if args.json:
            out.append(json.dumps({"line": n + 1, "parts": parts[n], "translations": [
                {"text": t.text, "score": t.score, "log_prob": t.log_prob, **quality_json(t),
                 **_alignment_field(t, args)} for t in translations]}, ensure_ascii=False))
        elif args.nbest > 1:
            out.extend(f"{n} ||| {_one_line(t.text)} ||| {t.score:.4f}" + _links(t, args)
                       for t in translations)
        else:
            out.append(_one_line(translations[0].text) + _links(translations[0], args))
    _write("".join(line + "\n" for line in out).encode("utf-8"), args.output if to_file else None)
    return 0


def read_prefixes(args: argparse.Namespace, lines: int) -> list[str] | None:
    """The lines of ``--target-prefix`` (None without it), one per input line.

    Raises:
        UserError: a line count other than the input's, naming both files.
    """
    if args.target_prefix is None:
        return None
    prefixes = read_input(args.target_prefix)
    if len(prefixes) != lines:
        source = "<stdin>" if args.input in (None, "-") else args.input
        raise UserError(f"--target-prefix {args.target_prefix} has {len(prefixes)} lines but "
                        f"the input {source} has {lines}: give one prefix line per input line "
                        "(an empty line for none)")
    return prefixes
def markup_settings(args: argparse.Namespace):
    """The :class:`~aiayn.decoding.markup.MarkupConfig` of ``--markup`` and ``--placeholder``
    (None without ``--markup``).

    Raises:
        ConfigError: a bad pattern, ``--placeholder`` without ``--markup``, or ``--markup``
            with ``--document``.
    """
    from aiayn.decoding.markup import DEFAULT_PLACEHOLDERS, MarkupConfig, Placeholder
    from aiayn.errors import ConfigError

    given = args.placeholder or []
    if not args.markup:
        if given:
            raise ConfigError("--placeholder needs --markup")
        return None
    if args.document:
        raise ConfigError("--markup reads one sentence a line; it does not go with --document")
    defaults = () if "none" in given else DEFAULT_PLACEHOLDERS
    return MarkupConfig(placeholders=(*defaults, *(Placeholder(p, "--placeholder")
                                                   for p in given if p != "none")))


def _alignment_field(t, args: argparse.Namespace) -> dict:
    """--json's ``alignment`` key (Pharaoh links) with --alignments; else nothing."""
    if not args.alignments:
        return {}
    return {"alignment": t.alignment.pharaoh() if t.alignment is not None else None}


def _links(t, args: argparse.Namespace) -> str:
    """`` ||| 0-0 1-2`` with --alignments (Marian's text form); else nothing."""
    if not args.alignments:
        return ""
    return " ||| " + (t.alignment.pharaoh() if t.alignment is not None else "")


def _translate_document(args: argparse.Namespace, text: str, progress: bool) -> bytes:
    """The translated document as UTF-8 (``--json``: one JSON object with each sentence)."""
    from aiayn.decoding.quality import to_json as quality_json

    translator = load_translator(args, "translate")
    options = decode_options(args)
    del options["nbest"]
    if options.pop("long_inputs") == "error":  # --reject-long: refused before decoding
        from aiayn.data.segment import segment

        sentences = segment(text, args.lang or translator.config.data.src_lang).sentences
        long = [n for n, ps in enumerate(translator.split_long_lines(sentences, lang=args.lang),
                                         1) if len(ps) > 1]
        if long:
            raise UserError(f"sentence {long[0]} of the document is longer than the model's "
                            f"max_len={translator.max_source_tokens} tokens (--reject-long); "
                            "shorten it, or leave out --reject-long to translate it in parts")
    result = translator.translate_document(text, lang=args.lang, progress=progress, **options)
    if not args.json:
        return result.text.encode("utf-8")
    doc = result.document
    sentences = [{"sentence": n + 1, "paragraph": doc.paragraphs[n] + 1, "source": src,
                  "translation": result.translations[n], "parts": result.parts[n],
                  **quality_json(result.best[n])}
                 for n, src in enumerate(doc.sentences)]
    return (json.dumps({"text": result.text, "sentences": sentences, "split": result.split},
                       ensure_ascii=False) + "\n").encode("utf-8")


def _write(data: bytes, path: str | None) -> None:
    """``data`` to ``path`` atomically, or to standard output (None)."""
    from aiayn.fileio import atomic_file

    if path is None:
        sys.stdout.buffer.write(data) if hasattr(sys.stdout, "buffer") else \
            sys.stdout.write(data.decode("utf-8"))
        sys.stdout.flush()
    else:
        with atomic_file(path) as f:
            f.write(data)
