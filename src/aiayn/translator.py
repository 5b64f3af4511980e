"""The one object between raw text and a trained model: :class:`Translator`.

A :class:`Translator` holds one model or an ensemble, its vocabulary, the text its model was
trained on (``data.preprocess``), its decode defaults, its device and its precision. Every
command that turns raw text into translations goes through it: ``aiayn translate``,
``evaluate``, ``attention``, ``serve``, the pipeline, validation during training and Table 3.

``Translator.from_pretrained`` loads:

- a checkpoint directory (``model.safetensors``, ``config.json``, ``tokenizer.json``), or the
  ``model.safetensors`` file in one;
- a finished run directory: the members, averaging and length penalty that the pipeline chose
  on the validation set, recorded in its generation record
  (:data:`aiayn.rundir.GENERATION_CONFIG`);
- a run directory without that record (a run of ``aiayn train``, or one still training): its
  averaged, best or newest checkpoint (an ensemble's: each member's), and says which;
- a list of any of these: an ensemble, whose next-token probabilities are averaged;
- a Hugging Face Marian (OPUS-MT) directory, converted on load (:mod:`aiayn.interop.marian`).

Example::

    from aiayn import Translator

    translator = Translator.from_pretrained("runs/multi30k-en-de")
    translator.translate(["A man rides a bike."])       # ['ein mann fährt fahrrad .']
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from aiayn.config import Config, DecodeConfig
from aiayn.errors import ConfigError
from aiayn.pretrained import Pretrained, load_pretrained

__all__ = ["DocumentTranslation", "Pretrained", "TextTranslations", "Translator",
           "join_parts", "load_pretrained"]  # the loader: aiayn.pretrained

_DECODE_FIELDS = tuple(f.name for f in dataclasses.fields(DecodeConfig))

logger = logging.getLogger("aiayn")


@dataclasses.dataclass(frozen=True)
class TextTranslations:
    """What :meth:`Translator.generate_text` gives for N lines.

    Attributes:
        translations: per line, up to ``nbest`` :class:`~aiayn.decoding.Translation`s.
        parts: per line, the parts it was translated in (1: it fit the model's max_len).
    """

    translations: list[list[Any]]
    parts: list[int]

    @property
    def split(self) -> list[int]:
        """The 1-based numbers of the lines translated in parts."""
        return [n for n, k in enumerate(self.parts, 1) if k > 1]


@dataclasses.dataclass(frozen=True)
class DocumentTranslation:
    """What :meth:`Translator.translate_document` gives.

    Attributes:
        text: the translated document, laid out as the source.
        document: the source cut into sentences (:class:`aiayn.data.segment.Document`).
        translations: one text per source sentence.
        parts: per sentence, the parts it was translated in (1: it fit the model's max_len).
        best: per sentence, its :class:`~aiayn.decoding.Translation` (confidence, flags).
    """

    text: str
    document: Any
    translations: list[str]
    parts: list[int]
    best: list[Any] = dataclasses.field(default_factory=list)

    @property
    def split(self) -> list[int]:
        """The 1-based numbers of the sentences translated in parts."""
        return [n for n, k in enumerate(self.parts, 1) if k > 1]


def join_parts(results: list[list[Any]], counts: list[int]) -> list[list[Any]]:
    """Put back together the translations of lines decoded in parts.

    Args:
        results: per part, its alternatives (:class:`~aiayn.decoding.Translation`), the parts
            of each line consecutive.
        counts: per line, its number of parts (they sum to ``len(results)``).

    Returns:
        Per line, its alternatives: a one-part line's as they are; a split line's k-th one
        joins its parts' k-th texts with a space, sums their ``score`` and ``log_prob``, and
        concatenates their tokens with one EOS at the end; its confidence and flags are
        :func:`aiayn.decoding.quality.joined`'s (all the parts' tokens, any part's flags),
        and its alignment the parts' joined, the words numbered on
        (:func:`~aiayn.decoding.alignment.join_alignments`).
    """
    from aiayn.data.vocab import EOS_ID
    from aiayn.decoding import Translation
    from aiayn.decoding.alignment import join_alignments
    from aiayn.decoding.quality import joined as joined_quality

    if sum(counts) != len(results):
        raise ValueError(f"join_parts: {len(results)} results for {sum(counts)} parts")
    out, i = [], 0
    for k in counts:
        group, i = results[i:i + k], i + k
        if k == 1:
            out.append(group[0])
            continue
        joined = []
        for r in range(min(len(alts) for alts in group)):
            ts = [alts[r] for alts in group]
            tokens = [t for x in ts for t in x.tokens if t != EOS_ID] + [EOS_ID]
            joined.append(Translation(" ".join(x.text for x in ts if x.text),
                                      sum(x.score for x in ts), sum(x.log_prob for x in ts),
                                      tokens, **joined_quality(ts),
                                      alignment=join_alignments([x.alignment for x in ts])))
        out.append(joined)
    return out


class Translator:
    """Raw text in, a model (or an ensemble), text out.

    It owns the raw-text contract: input lines are preprocessed as the model's training text
    was (``data.preprocess``, :func:`aiayn.data.text.model_text`), decoded with the model's
    own decode defaults (:attr:`decode_config`: beam size, alpha, lengths, ``beam_rules``)
    from the model's start token (``model.decoder_start_id``), on :attr:`device` at
    :attr:`precision`.

    Args:
        models: a :class:`~aiayn.model.Transformer` or a list of them (an ensemble: one
            vocabulary, one kind of text); moved to ``device``. Each is decoded in eval mode
            and left in the mode it came in.
        vocab: the shared vocabulary.
        config: the (first) model's run :class:`~aiayn.config.Config` (its ``data.preprocess``,
            ``decode`` and ``train.precision`` matter here); default: the model's own
            ``ModelConfig`` with default settings elsewhere (raw text, §6.1's search).
        decode: the decode defaults (default: ``config.decode``).
        device: a torch device name (default: where the first model is).
        precision: "fp32", "bf16", "int8" or "auto" (int8 where a short probe finds it faster
            than fp32 on this machine, :func:`aiayn.precision.choose_precision`);
            default fp32 (:func:`aiayn.precision.default_decoding_precision`).
        source: where the models came from (paths), for messages and ``aiayn serve``'s /info.
        warn: receives warnings about the input (default: the ``aiayn`` logger).
        workers: processes :meth:`generate` decodes in by default: 1 (this one), a count, or
            "auto" (on CPU, one one-thread process per torch thread over the one model,
            :mod:`aiayn.decoding.workers`; the commands use it). The output is the same.
        shortlist: a vocabulary shortlist (opt-in; it changes outputs): a
            :class:`~aiayn.decoding.shortlist.Shortlist`, or the path of its vmap file
            (``aiayn shortlist``); each sentence then produces only the tokens its source
            tokens list, scored over the batch's union (:mod:`aiayn.decoding.shortlist`).
            It applies to the searches (:meth:`generate`, and :meth:`attention` over the
            model's own output); :meth:`score` and a forced target use the whole vocabulary,
            since a given target may hold tokens off the list.
        length_range: the output/input length ratios seen on validation
            (:class:`~aiayn.decoding.quality.LengthRange`), which the ``length_ratio`` flag
            checks; default none (that flag is unchecked). :meth:`from_pretrained` loads a
            finished run's (its generation record's ``length_ratio``).

    Raises:
        ValueError: an empty ensemble; members with different output vocabularies or start
            tokens (:func:`aiayn.decoding.check_ensemble`).
    """

    def __init__(self, models, vocab, *, config: Config | None = None,
                 decode: DecodeConfig | None = None,
                 device: str | torch.device | None = None, precision: str | None = None,
                 source: list[str] | None = None,
                 warn: Callable[[str], None] | None = None, workers: int | str = 1,
                 shortlist=None, length_range=None) -> None:
        from aiayn.devices import choose_device
        from aiayn.precision import choose_precision, default_decoding_precision

        from aiayn.decoding import check_ensemble

        models = list(models) if isinstance(models, (list, tuple)) else [models]
        if models:
            self.device = choose_device(device) if device is not None else \
                next(models[0].parameters()).device
        self.models = [m.to(self.device) for m in models]  # decoded in eval mode, mode kept
        check_ensemble(self.models)
        self.config = config or Config(name="in-memory", model=models[0].config)
        config = self.config
        self.vocab = vocab
        self.source = source or []
        self._decode = decode or config.decode
        self.warn = warn or logger.warning
        requested = precision or default_decoding_precision(None, self.device)
        self.precision = choose_precision(requested, self.device, config.model, training=False)
        self._int8_models: list | None = None  # made at the first int8 decode, then kept
        from aiayn.decoding.workers import choose_workers

        choose_workers(workers, self.device, 1)  # a bad value is refused here, not later
        self.workers = workers
        if shortlist is not None and not hasattr(shortlist, "candidates"):
            from aiayn.decoding.shortlist import Shortlist

            shortlist = Shortlist.load(shortlist, vocab)
        self.shortlist = shortlist
        self.length_range = length_range

    @property
    def decoding_models(self) -> list:
        """The models :meth:`generate` decodes with: :attr:`models`, or at precision int8 their
        int8 copies (:func:`aiayn.model.quantize.quantize_int8`, made once). :meth:`score`
        and :meth:`attention` use :attr:`models`."""
        if not self.precision.uses_int8:
            return self.models
        if self._int8_models is None:
            from aiayn.data.vocab import EOS_ID
            from aiayn.model.quantize import quantize_int8

            # decoding scores only the tokens a model can produce (PAD, BOS, EOS keep ids 0-2)
            self._int8_models = [quantize_int8(m, step_fixed_ids=EOS_ID + 1)
                                 for m in self.models]
        return self._int8_models

    # --- loading --------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path | Sequence[str | Path], *,
                        device: str | torch.device | None = None, precision: str | None = None,
                        warn: Callable[[str], None] | None = None,
                        workers: int | str = 1, shortlist=None) -> Translator:
        """Load a checkpoint, a run directory (single or ensemble), a list of them (an
        ensemble) or a Hugging Face Marian directory; see the module's docstring.

        Args:
            device: "cpu", "cuda" or "cuda:N" (default: cuda when there is one, else cpu).
            precision: see :class:`Translator` (default for a finished run: the precision
                its pipeline decoded with, recorded in :data:`aiayn.rundir.GENERATION_CONFIG`).
            warn: receives what loading should say (a run whose training has not finished
                loads its newest checkpoint); default: the ``aiayn`` logger.
            workers, shortlist: see :class:`Translator`.

        Raises:
            UserError: a path that is none of these (naming it and what was expected);
                ensemble members with different vocabularies or kinds of text (naming them);
                weights that do not fit their config.
        """
        from aiayn.devices import choose_device

        dev = choose_device(device)
        loaded = load_pretrained(path, dev, warn or logger.warning)
        # the loader's config carries the run's chosen search settings and its precision
        if precision is None:
            precision = loaded.precision
        record = loaded.record
        if record.get("machine") and dev.type == "cpu":  # the kernels' facts at the run
            from aiayn.model.kernels import machine_differs

            differs = machine_differs(record["machine"], int8=precision == "int8")
            if differs:
                (warn or logger.warning)(f"{path}: decoding on another machine than the run's "
                                         f"({differs}): a few lines may differ from its output")
        from aiayn.decoding.quality import LengthRange

        length_range = LengthRange.from_record(record.get("length_ratio"),
                                               f"{path}: generation record")
        return cls(loaded.models, loaded.vocab, config=loaded.config,
                   decode=loaded.config.decode, device=dev, precision=precision,
                   source=loaded.sources, warn=warn, workers=workers, shortlist=shortlist,
                   length_range=length_range)

    # --- what it decodes with ---------------------------------------------------------------
    @property
    def decode_config(self) -> DecodeConfig:
        """The decode defaults: the run's choice on the validation set, else the model's
        ``config.decode`` (beam size, alpha, ``max_len_a``/``max_len_b``, batch size,
        ``beam_rules``)."""
        return self._decode

    @property
    def decoder_start_id(self) -> int:
        """The token every decoder input starts with (the model's ``decoder_start_id``)."""
        return self.models[0].config.decoder_start_id

    def decode_settings(self, **overrides: Any) -> DecodeConfig:
        """:attr:`decode_config` with the given fields replaced (None keeps the default).

        Raises:
            ValueError: an unknown field or a bad value, naming it.
        """
        given = {k: v for k, v in overrides.items() if v is not None}
        unknown = sorted(set(given) - set(_DECODE_FIELDS))
        if unknown:
            raise ConfigError(f"unknown decode setting(s): {', '.join(unknown)}")
        return dataclasses.replace(self._decode, **given) if given else self._decode

    def preprocess(self, lines: list[str], side: str = "src",
                   warn: Callable[[str], None] | None = None) -> list[str]:
        """``lines`` as the model reads them (``data.preprocess``; ``side`` "src" or "tgt")."""
        from aiayn.data.text import model_text

        return model_text(list(lines), self.config.data, side, warn=warn)

    # --- translating -----------------------------------------------------------------------
    def generate(self, lines: list[str], *, beam_size: int | None = None,
                 alpha: float | None = None, max_len_a: float | None = None,
                 max_len_b: int | None = None, batch_size: int | None = None,
                 beam_rules: str | None = None, nbest: int = 1, sampling=None,
                 long_inputs: str = "truncate", preprocessed: bool = False,
                 progress: bool = False, warn: Callable[[str], None] | None = None,
                 workers: int | str | None = None,
                 target_prefix: Sequence[str | None] | None = None, alternatives: bool = False,
                 markup=False, constraints=None, alignments: bool = False,
                 **engine: Any) -> list[list[Any]]:
        """Translate ``lines``: for each, up to ``nbest``
        :class:`~aiayn.decoding.Translation` objects (text, score, log_prob, tokens), best
        first. An empty line gives one empty translation.

        Args:
            beam_size, alpha, max_len_a, max_len_b, batch_size, beam_rules: override
                :attr:`decode_config` (§6.1: beam 4, alpha 0.6, input + 50 tokens).
            nbest: translations per line (needs beam search).
            sampling: a :class:`~aiayn.decoding.SamplingConfig` to sample instead.
            long_inputs: "truncate" (with a warning), "error", or "split": a line longer than
                the model's ``max_len`` is translated in parts and joined, with a warning
                naming it (:meth:`generate_text`).
            preprocessed: the lines are the model's text already (``data.preprocess``
                applied), as the training corpus is.
            workers: decode in this many processes (default :attr:`workers`; see
                :class:`Translator`).
            target_prefix: per line, the text its translation must begin with (None or ""
                for none; raw target text, or the model's with ``preprocessed``): the output's
                tokens begin with the prefix's exactly and the search continues from there
                (:mod:`aiayn.decoding.prefix`; a split line's prefix goes to its first part).
            alternatives: with ``nbest`` k, the k best tokens after the prefix, each
                continued by the search (CTranslate2's ``return_alternatives``); ``nbest``
                may then exceed the beam.
            markup: True or a :class:`~aiayn.decoding.markup.MarkupConfig`: each line's inline
                tags and placeholders are taken out, the plain text translated, and they are
                put back at the aligned target words, well-formed (:mod:`aiayn.decoding.markup`);
                each translation's ``text`` holds them, its ``tokens`` are the plain text's.
                Unbalanced tags: one warning naming the lines (or an error, as configured).
            constraints: per line, target phrases (text, read as the model's target side;
                None or [] for none) its translation must hold: terminology constraints
                placed by dynamic beam allocation (:mod:`aiayn.decoding.constraints`); lines
                without any decode exactly as without the option. A line whose phrases do not
                all fit in its maximum output is refused; one whose search runs out of length
                before placing them all is warned about. Not with ``alternatives``.
            alignments: fill each translation's ``alignment`` (word alignments from one
                teacher-forced pass over the output, :meth:`align`).
            engine: the guards ``no_repeat_ngram_size``, ``repetition_penalty``,
                ``min_length_ratio`` and ``max_length_ratio`` override :attr:`decode_config`
                as the fields above do (:mod:`aiayn.decoding.guards`; off by default); the
                rest is passed to :func:`aiayn.decoding.translate_nbest` (``use_cache``,
                ``min_len``: benchmarks; ``shortlist``: default :attr:`shortlist`;
                ``length_range``: default :attr:`length_range`).

        Raises:
            aiayn.errors.ConfigError: bad settings (naming them; a ``ValueError``).
            aiayn.decoding.InputTooLongError: a long line with ``long_inputs="error"``.
            aiayn.decoding.prefix.PrefixError: a prefix that cannot be forced (one too long
                for its line's output, a token the model never produces; naming the line).
        """
        from aiayn.decoding import translate_nbest

        if markup:  # tags and placeholders out, the plain text translated, put back
            from aiayn.decoding.markup import generate_marked

            return generate_marked(
                self, self.generate, lines, markup, warn=warn or self.warn, beam_size=beam_size,
                alpha=alpha, max_len_a=max_len_a, max_len_b=max_len_b, batch_size=batch_size,
                beam_rules=beam_rules, nbest=nbest, sampling=sampling, long_inputs=long_inputs,
                preprocessed=preprocessed, progress=progress, workers=workers,
                constraints=constraints, **engine)  # (alignments: always, for the markup)
        if long_inputs == "split":  # cut and joined around the search (generate_text)
            return self.generate_text(
                lines, beam_size=beam_size, alpha=alpha, max_len_a=max_len_a,
                max_len_b=max_len_b, batch_size=batch_size, beam_rules=beam_rules, nbest=nbest,
                sampling=sampling, preprocessed=preprocessed, progress=progress, warn=warn,
                workers=workers, target_prefix=target_prefix, alternatives=alternatives,
                constraints=constraints, alignments=alignments, **engine).translations
        warn = warn or self.warn
        from aiayn.decoding.guards import GUARD_FIELDS

        guards = {name: engine.pop(name) for name in GUARD_FIELDS if name in engine}
        decode = self.decode_settings(beam_size=beam_size, alpha=alpha, max_len_a=max_len_a,
                             max_len_b=max_len_b, batch_size=batch_size, beam_rules=beam_rules,
                             **guards)
        text = list(lines) if preprocessed else self.preprocess(lines, warn=warn)
        engine.setdefault("shortlist", self.shortlist)
        engine.setdefault("length_range", self.length_range)
        engine.update(sampling=sampling, bf16=self.precision.uses_bf16, long_inputs=long_inputs,
                      warn=warn, progress=progress,
                      workers=self.workers if workers is None else workers)
        if constraints is not None:
            from aiayn.decoding.constraints import encode_constraints

            if alternatives:
                raise ConfigError("constraints and alternatives cannot be combined: "
                                  "alternatives expand each line into several searches")
            engine["constraints"] = encode_constraints(self, constraints, len(text),
                                                       preprocessed=preprocessed)
        if target_prefix is not None or alternatives:
            from aiayn.decoding.prefix import decode_from_prefix, model_prefixes

            if target_prefix is not None:
                target_prefix = model_prefixes(self, target_prefix, len(text),
                                               preprocessed=preprocessed)
            out = decode_from_prefix(self, text, target_prefix, decode, nbest=nbest,
                                     alternatives=alternatives, **engine)
        else:
            out = translate_nbest(self.decoding_models, self.vocab, text, decode, nbest=nbest,
                                  **engine)
        if constraints is not None:
            from aiayn.decoding.constraints import warn_unplaced

            warn_unplaced(engine["constraints"], out, warn)
        if alignments:
            out = self.with_alignments(list(lines), text, out)
        return out

    def translate(self, lines: list[str], *, nbest: int = 1, **options: Any
                  ) -> list[str] | list[list[str]]:
        """The best translation of each line as text, in input order; with ``nbest > 1``, a
        list of ``nbest`` texts per line. Options as :meth:`generate`."""
        out = self.generate(lines, nbest=nbest, **options)
        if nbest == 1:
            return [t[0].text for t in out]
        return [[t.text for t in ts] for ts in out]

    # --- real text: long lines and documents (aiayn.data.segment) -------------------------
    @property
    def max_source_tokens(self) -> int:
        """The most subword tokens a source line may have, EOS included: the smallest
        ``model.max_len`` of the models (the positional table, §3.5)."""
        return min(m.config.max_len for m in self.models)

    def split_long_lines(self, lines: Sequence[str], *, lang: str | None = None,
                         preprocessed: bool = False) -> list[list[str]]:
        """Each line's parts: ``[line]`` when its subword tokens with EOS fit
        :attr:`max_source_tokens`, else the parts :func:`aiayn.data.segment.split_long` cuts
        it into (at sentence ends, then ``;`` ``:``, then commas, then a window of words),
        each of which fits.

        Args:
            lang: the source language for the sentence splitter (default ``data.src_lang``).
            preprocessed: the lines are the model's text already (``data.preprocess``).
        """
        from aiayn.data.segment import split_long

        lang = lang or self.config.data.src_lang
        limit = self.max_source_tokens
        quiet = lambda msg: None  # noqa: E731  (the caller warns about the input once)

        def read(texts: list[str]) -> list[str]:
            return list(texts) if preprocessed else self.preprocess(texts, warn=quiet)

        def fits(part: str) -> bool:
            return len(self.vocab.encode(read([part])[0])) + 1 <= limit

        lines = list(lines)
        counts = [len(ids) + 1 for ids in self.vocab.encode_batch(read(lines))] if lines else []
        return [[line] if n <= limit else split_long(line, lang, fits)
                for line, n in zip(lines, counts)]

    def generate_text(self, lines: Sequence[str], *, lang: str | None = None, nbest: int = 1,
                      preprocessed: bool = False, warn: Callable[[str], None] | None = None,
                      **options: Any) -> TextTranslations:
        """:meth:`generate` for text of any length: a line longer than the model's ``max_len``
        is cut into parts (:meth:`split_long_lines`), the parts are decoded in the same batch
        as the other lines, and their translations joined with a space, in order. Nothing is
        truncated; ``warn`` names the lines that were split.

        A split line's k-th alternative joins its parts' k-th ones (as many as every part
        has); its ``log_prob`` and ``score`` are the parts' sums and its ``tokens`` the parts'
        ids with one EOS at the end.

        Args:
            lang: the source language for the sentence splitter (default ``data.src_lang``).
            options: as :meth:`generate` (``long_inputs`` excepted); a split line's
                ``target_prefix`` goes to its first part (with ``alternatives``, every part
                gives its alternatives, and the k-th ones are joined); ``markup`` is applied
                to the whole line, before it is cut.

        Returns:
            A :class:`TextTranslations`: per line, up to ``nbest`` translations, and its count
            of parts.

        Raises:
            aiayn.errors.ConfigError: bad settings (naming them).
        """
        warn = warn or self.warn
        if options.get("markup"):  # taken out before the lines are cut, put back after
            from aiayn.decoding.markup import generate_marked

            return generate_marked(self, self.generate_text, lines, options.pop("markup"),
                                   warn=warn, lang=lang, nbest=nbest, preprocessed=preprocessed,
                                   **options)
        options.pop("markup", None)
        lines = list(lines)
        prefixes = options.pop("target_prefix", None)
        if prefixes is not None:  # the model's text, each on its line's first part
            from aiayn.decoding.prefix import model_prefixes

            prefixes = model_prefixes(self, prefixes, len(lines), preprocessed=preprocessed)
        if not preprocessed:
            lines = self.preprocess(lines, warn=warn)  # warned about once, here
        parts = self.split_long_lines(lines, lang=lang, preprocessed=True)
        flat = [p for ps in parts for p in ps]
        counts = [len(ps) for ps in parts]
        if prefixes is not None:
            from aiayn.decoding.prefix import first_parts

            options["target_prefix"] = first_parts(prefixes, counts)
        if options.get("constraints") is not None:  # a split line's go to its first part
            from aiayn.decoding.constraints import preprocess_constraints, spread_over_parts

            given = options["constraints"]
            if len(given) == len(lines) and not preprocessed:
                given = preprocess_constraints(self, given)
            if len(given) == len(lines):
                options["constraints"] = spread_over_parts(given, [len(ps) for ps in parts])
        out = self.generate(flat, nbest=nbest, long_inputs="error", preprocessed=True,
                            warn=warn, **options)
        split = [n for n, k in enumerate(counts, 1) if k > 1]
        if split:
            shown = ", ".join(map(str, split[:10])) + (", ..." if len(split) > 10 else "")
            warn(f"{len(split)} input line(s) longer than the model's max_len="
                 f"{self.max_source_tokens} tokens, translated in parts and joined "
                 f"(line {shown})")
        return TextTranslations(join_parts(out, counts), counts)

    def translate_document(self, text: str, *, lang: str | None = None,
                           **options: Any) -> DocumentTranslation:
        """Translate plain text with paragraphs: each paragraph is cut into sentences
        (:func:`aiayn.data.segment.segment`, with the source language's abbreviations), all
        sentences are decoded as one batch (a sentence too long for the model in parts, as
        :meth:`generate_text`), and the translations are put back with every paragraph break,
        blank line and leading and trailing whitespace kept (:meth:`Document.rejoin`).

        Args:
            text: the document; paragraphs are separated by blank lines, and a line break
                between two sentences is kept (so one sentence a line stays so).
            lang: the source language (default: the model's ``data.src_lang``).
            options: as :meth:`generate` (``nbest`` and ``long_inputs`` excepted).

        Returns:
            A :class:`DocumentTranslation` (``.text``: the translated document).
        """
        from aiayn.data.segment import segment

        doc = segment(text, lang or self.config.data.src_lang)
        result = self.generate_text(doc.sentences, lang=lang, **options)
        texts = [ts[0].text for ts in result.translations]
        return DocumentTranslation(doc.rejoin(texts), doc, texts, result.parts,
                                   [ts[0] for ts in result.translations])

    # --- scoring and attention --------------------------------------------------------------
    @torch.inference_mode()
    def score(self, sources: list[str], targets: list[str], *, preprocessed: bool = False,
              batch_size: int | None = None) -> list[float]:
        """log P(target | source) of each pair under the model, teacher-forced from the
        start token (§3: the decoder input is the target shifted right).

        Args:
            sources, targets: N sentences each, raw (or the model's text with
                ``preprocessed``).
            batch_size: pairs per forward pass (default: ``decode_config.batch_size``).

        Returns:
            N floats: natural-log probabilities, summed over each target's subword tokens and
            its EOS (so <= 0); for an ensemble, each token's probability is the mean of its
            members'.

        Raises:
            ValueError: ``sources`` and ``targets`` of different lengths, or an empty target.
            aiayn.decoding.InputTooLongError: a sentence longer than the model's ``max_len``.
        """
        import math

        from aiayn.data.batching import pad_sources
        from aiayn.data.vocab import PAD_ID
        from aiayn.decoding import encode_sources
        from aiayn.model import kernels

        if len(sources) != len(targets):
            raise ValueError(f"score: {len(sources)} sources but {len(targets)} targets")
        if not preprocessed:
            sources, targets = self.preprocess(sources), self.preprocess(targets, "tgt")
        max_len = min(m.config.max_len for m in self.models)
        src_ids = encode_sources(self.vocab, list(sources), max_len, long_inputs="error")
        tgt_ids = encode_sources(self.vocab, list(targets), max_len, long_inputs="error")
        empty = [n for n, ids in enumerate(tgt_ids, 1) if len(ids) == 1]
        if empty:
            raise ValueError(f"score: target {empty[0]} is empty")
        out: list[float] = []
        step = batch_size or self._decode.batch_size
        for i in range(0, len(src_ids), step):
            src = pad_sources(src_ids[i:i + step]).to(self.device)  # (B, S)
            tgt_out = pad_sources(tgt_ids[i:i + step]).to(self.device)  # (B, T)
            tgt_in = torch.cat([torch.full_like(tgt_out[:, :1], self.decoder_start_id),
                                tgt_out[:, :-1]], dim=1)
            with self._autocast(), self._eval():
                # decoding's one log-softmax (the searches' own; torch's under autocast)
                logps = [kernels.log_softmax(m(src, tgt_in)) for m in self.models]
            logp = logps[0] if len(logps) == 1 else \
                torch.logsumexp(torch.stack(logps), dim=0) - math.log(len(logps))
            token = logp.gather(2, tgt_out[:, :, None]).squeeze(2)  # (B, T)
            out += token.masked_fill(tgt_out == PAD_ID, 0.0).sum(dim=1).tolist()
        return out

    def attention(self, source: str, target: str | None = None, *,
                  beam_size: int | None = None, alpha: float | None = None,
                  max_len_b: int | None = None, preprocessed: bool = False):
        """Every layer's and head's attention (encoder self, decoder self, cross) for one
        sentence, as :class:`aiayn.viz.attention.AttentionMaps`: with ``target`` forced, else
        over the model's own beam-search output (:attr:`decode_config`, overridable). An
        ensemble shows its first member's attention over the ensemble's output.

        Raises:
            ValueError: an empty source or target, or one longer than the model's max_len.
        """
        from aiayn.viz.attention import attention_maps

        if not preprocessed:
            source = self.preprocess([source])[0]
            target = None if target is None else self.preprocess([target], "tgt")[0]
        out_ids = score = None
        if target is None:
            if not source.strip():
                raise ValueError("the source sentence is empty")
            best = self.generate([source], beam_size=beam_size, alpha=alpha,
                                 max_len_b=max_len_b, long_inputs="error", preprocessed=True)
            out_ids, score = best[0][0].tokens, best[0][0].score
        with self._autocast():
            return attention_maps(self.models[0], self.vocab, source, target, out_ids=out_ids,
                                  score=score)

    # --- word alignments (aiayn.decoding.alignment) -------------------------------------------
    def align(self, sources: list[str], targets: list[str], *, preprocessed: bool = False,
              layer: int | None = None, batch_size: int | None = None) -> list[Any]:
        """Word alignments of given (source, target) pairs: one teacher-forced pass of the
        model (an ensemble's first member; :func:`aiayn.decoding.alignment.align_pairs`:
        the layer and the rules are there).

        Args:
            sources, targets: N sentences each, raw (or the model's text with
                ``preprocessed``); their whitespace words are the words aligned.
            layer: the decoder layer to read (default: the guided layer and head of a model
                trained with guided alignment, else the last layer's mean over heads).
            batch_size: pairs per forward pass (default: ``decode_config.batch_size``).

        Returns:
            N :class:`~aiayn.decoding.alignment.Alignment` (``.pharaoh()``: ``"0-0 1-2"``).

        Raises:
            ValueError: lists of different lengths, or a bad layer.
            aiayn.decoding.InputTooLongError: a sentence longer than the model's ``max_len``.
        """
        from aiayn.decoding import encode_sources

        if len(sources) != len(targets):
            raise ValueError(f"align: {len(sources)} sources but {len(targets)} targets")
        model_src = list(sources) if preprocessed else self.preprocess(sources)
        model_tgt = list(targets) if preprocessed else self.preprocess(targets, "tgt")
        max_len = self.max_source_tokens
        src_ids = encode_sources(self.vocab, model_src, max_len, long_inputs="error")
        tgt_ids = encode_sources(self.vocab, model_tgt, max_len, long_inputs="error")
        return self._align(sources, model_src, src_ids, targets, model_tgt, tgt_ids, layer,
                           batch_size)

    def with_alignments(self, lines: list[str], text: list[str], results: list[list[Any]], *,
                        layer: int | None = None) -> list[list[Any]]:
        """``results`` (per line, its :class:`~aiayn.decoding.Translation` s) with their
        ``alignment`` filled, for ``lines`` as given and ``text`` as the model read them."""
        import dataclasses as dc

        from aiayn.decoding import encode_sources

        quiet = lambda msg: None  # noqa: E731  (decoding warned about long lines already)
        src_ids = encode_sources(self.vocab, list(text), self.max_source_tokens, warn=quiet)
        flat = [(n, t) for n, ts in enumerate(results) for t in ts]
        found = self._align([lines[n] for n, _ in flat], [text[n] for n, _ in flat],
                            [src_ids[n] for n, _ in flat], [t.text for _, t in flat],
                            [t.text for _, t in flat], [t.tokens for _, t in flat], layer,
                            None)
        it = iter(found)
        return [[dc.replace(t, alignment=next(it)) for t in ts] for ts in results]

    def _align(self, sources, model_src, src_ids, targets, model_tgt, tgt_ids, layer,
               batch_size) -> list[Any]:
        from aiayn.decoding.alignment import align_pairs

        tokenize = None
        if self.config.data.preprocess != "none":
            tokenize = lambda text, side: self.preprocess([text], side)[0]  # noqa: E731
        with self._autocast():
            return align_pairs(self.models[0], self.vocab, self.config, list(sources),
                               list(model_src), src_ids, list(targets), list(model_tgt),
                               tgt_ids, layer=layer,
                               batch_size=batch_size or self._decode.batch_size,
                               tokenize=tokenize)

    @contextlib.contextmanager
    def _eval(self):
        """The models in eval mode (no dropout), each put back in the mode it came in."""
        modes = [m.training for m in self.models]
        try:
            for m in self.models:
                m.eval()
            yield
        finally:
            for m, mode in zip(self.models, modes):
                m.train(mode)

    def _autocast(self):
        if self.precision.uses_bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def __repr__(self) -> str:
        what = f"an ensemble of {len(self.models)}" if len(self.models) > 1 else "one model"
        return (f"Translator({what}, {self.source or 'in memory'}, device={self.device}, "
                f"precision={self.precision.chosen}, decode={self._decode})")
