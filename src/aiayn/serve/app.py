"""The HTTP server of ``aiayn serve``: a JSON API over one :class:`aiayn.Translator` (a
checkpoint, a run directory or an ensemble), and a page at ``/``.

Endpoints:

* ``POST /translate`` ``{"lines": [...], "beam": 4, "alpha": 0.6, "nbest": 1}``: every line's
  translations, best first, with score and log-probability (decoded in batches with other
  requests, see :mod:`aiayn.serve.batcher`). With ``"alignments": true``, each also carries
  ``alignment``: its word alignment to the line, Pharaoh links ``"0-0 1-2"``
  (:mod:`aiayn.decoding.alignment`).
  With ``"split_long": true``, a line longer than the model's ``max_len`` is translated in
  parts and joined (:meth:`aiayn.Translator.split_long_lines`) instead of answering 413;
  ``parts`` says, per line, how many parts it was translated in (1: it fit).
  ``"target_prefix": [...]`` (one per line, null for none) makes each translation begin with
  its text, and ``"alternatives": true`` with ``nbest`` K gives the K best continuations after
  it (:mod:`aiayn.decoding.prefix`); a prefix that cannot be forced answers 422.
  With ``"constraints": [["phrase", ...], [], ...]`` (one list per line), each line's
  translation holds its target phrases (:mod:`aiayn.decoding.constraints`); bad or
  impossible constraints answer 422 naming the line.
  With ``"markup": true``, inline tags and placeholders are taken out before translation and
  put back at the aligned words, well-formed (:mod:`aiayn.decoding.markup`); unbalanced tags
  are carried as written, with a warning.
* ``POST /document`` ``{"text": "...", "lang": "en", "beam": 4, "alpha": 0.6}``: plain text
  with paragraphs, cut into sentences (:mod:`aiayn.data.segment`), decoded as one batch
  (an over-long sentence in parts) and put back with its line breaks, blank lines and
  surrounding whitespace: ``text``, and per sentence its ``source``, ``translation``,
  ``paragraph`` and ``parts``; ``split`` lists the sentences translated in parts.
* Both take the guards ``no_repeat_ngram_size``, ``repetition_penalty``,
  ``min_length_ratio`` and ``max_length_ratio`` (:mod:`aiayn.decoding.guards`; default: the
  model's decode settings, all off); requests with other guards are decoded in other batches.
* Every translation (and every /document sentence) carries its ``confidence`` (log-probability
  per token, EOS included), ``flags`` (likely failures: ``repeat``, ``length_ratio``, ``copy``,
  ``no_eos``) and ``unchecked`` (flags not evaluated), as :mod:`aiayn.decoding.quality`
  defines them.
* ``POST /attention`` ``{"source": "...", "target": "..."}``: every layer and head of the
  three kinds of attention for one pair; without ``target``, the model's own beam output.
* Both answer ``warnings``, a list of sentences, empty when all is well: for now, that the
  input looks tokenized already to a model that tokenizes its input itself
  (:func:`aiayn.data.text.tokenized_input_warning`). Such input is still translated.
* ``GET /health``: ``{"status": "ok"}``. ``GET /info``: the model's config, parameter count,
  vocabulary size, decoding defaults, the vocabulary shortlist (``aiayn serve --shortlist``:
  its file, the ``always`` tokens and the source-target ``pairs``; null without one), the
  ``length_ratio`` flag's validation range (null: that flag is unchecked), the
  server's limits, and its ``load`` now
  (``requests_in_flight``, ``queued_lines`` waiting for a batch, ``batches_run`` since start).

Every input is bounded (:class:`ServeLimits`). A body or request too large answers 413, bad
JSON or settings 422, a full queue or too many requests in flight 429, a server shutting down
503; the ``detail`` of each says what was too big or wrong and what the limit is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from importlib import resources

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import BaseModel, ConfigDict, Field

from aiayn.serve.batcher import Batcher, QueueFullError, ShuttingDownError
from aiayn.serve.limits import ServeLimits


class GuardOptions(BaseModel):
    """The guards a request may set (:mod:`aiayn.decoding.guards`; null: the model's decode
    default, off unless its config says otherwise). Checked by
    :class:`~aiayn.config.DecodeConfig`; a bad value answers 422 naming it."""

    no_repeat_ngram_size: int | None = Field(
        None, description="no n consecutive output tokens twice (0 = off)")
    repetition_penalty: float | None = Field(
        None, description="a token generated before has its log-probability multiplied by "
                          "this; > 1 penalizes repeats (1 = off)")
    min_length_ratio: float | None = Field(
        None, description="no end of sentence before this times the input's tokens (0 = off)")
    max_length_ratio: float | None = Field(
        None, description="at most this times the input's tokens (Marian's "
                          "--max-length-factor)")


class TranslateRequest(GuardOptions):
    """Body of ``POST /translate``; an unknown field or a value out of range answers 422."""

    model_config = ConfigDict(extra="forbid")
    lines: list[str] = Field(description="sentences to translate, one per item")
    beam: int | None = Field(None, ge=1, description="beam size; 1 = greedy")
    alpha: float | None = Field(None, ge=0.0, le=10.0, description="length penalty exponent")
    nbest: int = Field(1, ge=1, description="translations per line, <= beam")
    split_long: bool = Field(False, description="translate a line over the model's max_len "
                                                "in parts and join them (else 413)")
    target_prefix: list[str | None] | None = Field(
        None, description="per line, the text its translation must begin with (null or \"\" "
                          "for none); as many items as lines")
    alternatives: bool = Field(False, description="with nbest K: the K most likely tokens "
                               "after each prefix, each continued by the search (K may exceed "
                               "beam, up to the server's largest beam)")
    markup: bool = Field(False, description="carry inline tags and placeholders through "
                                            "translation (aiayn.decoding.markup)")
    constraints: list[list[str]] | None = Field(
        None, description="per line, target phrases its translation must hold ([] for none)")
    alignments: bool = Field(False, description="each translation's word alignment to its "
                                                "line, Pharaoh links '0-0 1-2' (source-target)")


class DocumentRequest(GuardOptions):
    """Body of ``POST /document``: plain text with paragraphs separated by blank lines."""

    model_config = ConfigDict(extra="forbid")
    text: str = Field(description="the document")
    lang: str | None = Field(None, max_length=16, description="source language (ISO 639) for "
                             "cutting sentences; default: the model's data.src_lang")
    beam: int | None = Field(None, ge=1, description="beam size; 1 = greedy")
    alpha: float | None = Field(None, ge=0.0, le=10.0, description="length penalty exponent")


class AttentionRequest(BaseModel):
    """Body of ``POST /attention``: one source line, and optionally the target to force."""

    model_config = ConfigDict(extra="forbid")
    source: str = Field(description="the source sentence (one line)")
    target: str | None = Field(None, description="force this translation; none: beam output")
    beam: int | None = Field(None, ge=1, description="beam size for the model's own output")
    alpha: float | None = Field(None, ge=0.0, le=10.0, description="length penalty exponent")


class BodyLimit:
    """ASGI middleware: a body over ``max_bytes`` answers 413 before it is read in full."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_bytes
        message = (f"request body too large: at most {limit} bytes are accepted")
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                return await _send_json(send, 413, message + f", got {int(value)}")
        received = 0
        started = rejected = False

        async def limited_receive():
            nonlocal received, rejected
            msg = await receive()
            if msg["type"] == "http.request" and not rejected:
                received += len(msg.get("body", b""))
                if received > limit and not started:
                    # answer now; the app sees a client that went away, and whatever it
                    # answers to that is dropped below
                    rejected = True
                    await _send_json(send, 413, message + f", got more than {limit}")
                    return {"type": "http.disconnect"}
            return msg

        async def guarded_send(msg):
            nonlocal started
            if rejected:
                return
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        await self.app(scope, limited_receive, guarded_send)


@dataclass
class InFlight:
    """The POST requests being answered now (queued ones included); shared between
    :class:`ConcurrencyLimit`, which counts them, and ``GET /info``, which reports them."""

    requests: int = 0


class ConcurrencyLimit:
    """ASGI middleware: at most ``max_concurrent`` POST requests are answered at once; one more
    answers 429 at once (no request waits unbounded)."""

    def __init__(self, app, max_concurrent: int, in_flight: InFlight) -> None:
        self.app = app
        self.max_concurrent = max_concurrent
        self.in_flight = in_flight

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        if self.in_flight.requests >= self.max_concurrent:
            return await _send_json(
                send, 429, f"too many requests in flight: {self.in_flight.requests} are being "
                f"answered (at most {self.max_concurrent}); retry later", {"retry-after": "1"})
        self.in_flight.requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight.requests -= 1


async def _send_json(send, status: int, detail: str, headers: dict | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _validation_detail(err: RequestValidationError) -> str:
    parts = []
    for e in err.errors():
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


def create_app(translator, limits: ServeLimits | None = None) -> FastAPI:
    """The ASGI application serving ``translator`` (an :class:`aiayn.Translator`: one model
    or an ensemble, with its preprocessing, decode defaults, device and precision).

    ``translator.workers`` says where ``/translate`` batches are decoded
    (:func:`aiayn.decoding.workers.choose_workers`; ``aiayn serve --workers``): 1, on one
    thread of this process; more (or ``"auto"`` on a CPU with several torch threads), each
    batch in one of that many one-thread processes forked here, now, before the server starts
    any thread (:class:`aiayn.decoding.workers.WorkerPool`), up to that many batches at once.
    The answers are the same either way. ``/attention`` runs on one thread of this process.
    The batcher starts and stops with the app's lifespan (stopping finishes every queued
    request first, then ends the processes).
    """
    from aiayn.decoding.markup import copyable, parse_lines, restore_translations
    from aiayn.decoding.constraints import merge_constraints
    from aiayn.data.segment import segment
    from aiayn.data.text import tokenized_input_warning
    from aiayn.decoding.guards import GUARD_FIELDS, guard_settings
    from aiayn.errors import ConfigError
    from aiayn.decoding.quality import to_json as quality_json
    from aiayn.translator import join_parts
    from aiayn.decoding.prefix import (PrefixError, check_prefixes, encode_prefixes, first_parts,
                                       model_prefixes)
    from aiayn.errors import UserError
    from aiayn.decoding.workers import WorkerPool, choose_workers
    from aiayn.model.transformer import count_parameters

    limits = limits or ServeLimits()
    config, vocab = translator.config, translator.vocab
    decode = translator.decode_config
    max_len = min(m.config.max_len for m in translator.models)
    model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aiayn-model")

    def run_batch(items: list[tuple[str, str | None, tuple | None]], key: tuple):
        # an item: a line (the model's text), its target prefix and its constraints' phrases;
        # key: beam, alpha, nbest, the guards ((field, value), ...: guard_key), alternatives
        beam, alpha, nbest, guards, alternatives = key
        lines = [line for line, _, _ in items]
        prefixes = [prefix for _, prefix, _ in items]
        phrases = [list(p) if p else None for _, _, p in items]
        options = dict(guards)
        if alternatives or any(p is not None for p in prefixes):
            options.update(target_prefix=prefixes, alternatives=alternatives)
        if any(phrases):
            options["constraints"] = phrases
        return translator.generate(lines, beam_size=beam, alpha=alpha, nbest=nbest,
                                   batch_size=limits.max_batch_lines, long_inputs="error",
                                   preprocessed=True, workers=1, **options)

    workers = choose_workers(translator.workers, translator.device, limits.max_concurrent)
    pool = None
    decode_batch, batch_threads = run_batch, model_thread  # one model, one thread
    if workers > 1:
        from aiayn.model.kernels import warm_up

        _ = translator.decoding_models  # the int8 copies: made once, here, and shared
        warm_up()  # the kernels compiled (or loaded) once here, not once per process
        pool = WorkerPool(lambda task: run_batch(*task), workers)
        decode_batch = lambda lines, key: pool.run((lines, key))  # noqa: E731
        batch_threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="aiayn-pool")
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher = Batcher(decode_batch, max_batch_lines=limits.max_batch_lines,
                          max_wait_s=limits.max_wait_ms / 1000,
                          max_queue_lines=limits.max_queue_lines, executor=batch_threads,
                          concurrency=workers)
        batcher.start()
        state["batcher"] = batcher
        try:
            yield
        finally:
            await batcher.stop()
            model_thread.shutdown(wait=True)
            if pool is not None:
                batch_threads.shutdown(wait=True)
                pool.close()

    app = FastAPI(title="aiayn", lifespan=lifespan,
                  description="Translate with a Transformer and look at its attention.")
    in_flight = InFlight()
    app.add_middleware(ConcurrencyLimit, max_concurrent=limits.max_concurrent,
                       in_flight=in_flight)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)  # outermost: runs first

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        return JSONResponse({"detail": _validation_detail(err)}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        # a body FastAPI cannot parse (not UTF-8 JSON) is a bad request like any other: 422
        if err.status_code == 400:
            return JSONResponse({"detail": "invalid request: the body is not JSON in UTF-8"},
                                status_code=422)
        return JSONResponse({"detail": err.detail}, status_code=err.status_code,
                            headers=getattr(err, "headers", None))

    def search_settings(beam: int | None, alpha: float | None, nbest: int = 1):
        beam = decode.beam_size if beam is None else beam
        alpha = decode.alpha if alpha is None else alpha
        if beam > limits.max_beam:
            raise HTTPException(422, f"beam {beam} is larger than this server allows "
                                     f"(at most {limits.max_beam})")
        if nbest > beam:
            raise HTTPException(422, f"nbest {nbest} needs a beam at least as large "
                                     f"(beam is {beam})")
        return beam, alpha, nbest

    def guard_key(req: GuardOptions) -> tuple:
        """The guards ``req`` sets, as part of its batch key: requests with other guards
        are never decoded in one batch (:class:`Batcher` batches equal keys only)."""
        given = {name: getattr(req, name) for name in GUARD_FIELDS
                 if getattr(req, name) is not None}
        try:
            translator.decode_settings(**given)
        except ConfigError as err:
            raise HTTPException(422, str(err).replace("DecodeConfig.", "")) from None
        return tuple(sorted(given.items()))

    def check_chars(text: str, what: str) -> None:
        """``text`` as sent: bounded before any work is done on it, and Unicode that UTF-8
        can carry (JSON's \\ud800 escapes a lone surrogate, which no tokenizer takes)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise HTTPException(422, f"{what} is not valid Unicode: a lone surrogate "
                                     f"{text[err.start]!r} at character {err.start + 1}"
                                     ) from None
        if len(text) > limits.max_chars:
            raise HTTPException(413, f"{what} has {len(text)} characters; at most "
                                     f"{limits.max_chars} are accepted")

    def check_tokens(read: str, what: str, max_tokens: int) -> None:
        """``read``: the text as the model reads it (:func:`model_text`). Moses tokenization
        can make a line longer ("dog's" -> "dog &apos;s"), and a line over max_len would fail
        its whole batch."""
        n = len(vocab.encode(read)) + 1  # with </s>
        if n > max_tokens:
            how = ("" if config.data.preprocess == "none"
                   else f" after the model's {config.data.preprocess} preprocessing")
            raise HTTPException(413, f"{what} has {n} subword tokens with </s>{how}; at most "
                                     f"{max_tokens} are accepted")

    def batcher() -> Batcher:
        return state["batcher"]

    def warnings(lines: list[str], what: str = "") -> list[str]:
        """What a client should know about ``lines`` (the request's ``what`` lines)."""
        message = tokenized_input_warning(lines, config.data)
        return [] if message is None else [what + message]

    @app.post("/translate")
    async def translate(req: TranslateRequest):
        if not req.lines:
            raise HTTPException(422, "lines is empty: give at least one sentence")
        if len(req.lines) > limits.max_lines:
            raise HTTPException(413, f"{len(req.lines)} lines in one request; at most "
                                     f"{limits.max_lines} are accepted")
        for n, line in enumerate(req.lines, 1):
            if "\n" in line or "\r" in line:
                raise HTTPException(422, f"line {n} contains a line break: send one sentence "
                                         "per item of lines")
            check_chars(line, f"line {n}")
        marked, notes, wanted = None, [], req.constraints
        if req.markup:  # tags and placeholders out (those to copy kept, as constraints)
            if "copyable" not in state:
                state["copyable"] = copyable(translator)
            marked = parse_lines(req.lines, warn=notes.append, keep_copies=state["copyable"])
            if any(m.constraints for m in marked) and (wanted is None
                                                       or len(wanted) == len(marked)):
                wanted = [ps or [] for ps in merge_constraints(
                    wanted, [m.constraints for m in marked])]
        read = translator.preprocess(req.lines if marked is None else [m.plain for m in marked])
        if not req.split_long:
            for n, line in enumerate(read, 1):
                check_tokens(line, f"line {n}", max_len)
        prefixes = None
        if req.target_prefix is not None:
            for n, text in enumerate(req.target_prefix, 1):
                check_chars(text or "", f"target_prefix {n}")
            try:
                prefixes = model_prefixes(translator, req.target_prefix, len(req.lines))
            except PrefixError as err:
                raise HTTPException(422, str(err)) from None
        phrases = None
        if wanted is not None:
            from aiayn.decoding.constraints import ConstraintError, check_request

            if req.alternatives:
                raise HTTPException(422, "constraints and alternatives cannot be combined")
            for n, given in enumerate(wanted, 1):
                for k, phrase in enumerate(given, 1):
                    check_chars(phrase, f"constraint {k} of line {n}")
            try:
                phrases = check_request(translator, read, wanted)
            except ConstraintError as err:
                raise HTTPException(422, str(err)) from None
        key = (*search_settings(req.beam, req.alpha, 1 if req.alternatives else req.nbest),
               guard_key(req), req.alternatives)
        if req.alternatives:
            if req.nbest > limits.max_beam:
                raise HTTPException(422, f"nbest {req.nbest} alternatives are more than this "
                                         f"server allows (at most {limits.max_beam})")
            key = (key[0], key[1], req.nbest, key[3], True)
        sent = req.lines if marked is None else [m.plain for m in marked]
        results, parts, batch_lines = await decode_in_parts(
            read, key, prefixes=prefixes, constraints=phrases,
            given=sent if req.alignments or marked is not None else None)
        if marked is not None:
            results = restore_translations(marked, results)
        return {"translations": [[{"text": t.text, "score": t.score, "log_prob": t.log_prob,
                                   **quality_json(t),
                                   **({"alignment": t.alignment and t.alignment.pharaoh()}
                                      if req.alignments else {})}
                                  for t in line] for line in results],
                "beam": key[0], "alpha": key[1], "nbest": key[2], "batch_lines": batch_lines,
                "parts": parts, "warnings": warnings(req.lines) + notes}

    async def decode_in_parts(read: list[str], key, lang: str | None = None,
                              prefixes: list[str | None] | None = None,
                              constraints: list | None = None,
                              given: list[str] | None = None):
        """``read`` (the model's text) decoded in the batcher, a line over ``max_len`` in
        parts (its target prefix and its ``constraints``, the model's text, on its first
        part): (translations per line, parts per line, the batch's lines). With ``given``
        (the lines as sent), each translation's word alignment is added (on this process's
        model thread, after the batch)."""
        parts = translator.split_long_lines(read, lang=lang, preprocessed=True)
        counts = [len(ps) for ps in parts]
        if sum(counts) > limits.max_lines:
            raise HTTPException(413, f"{sum(counts)} sentences and parts of long lines in one "
                                     f"request; at most {limits.max_lines} are accepted")
        flat = [p for ps in parts for p in ps]
        flat_prefixes = first_parts(prefixes, counts) or [None] * len(flat)
        if prefixes is not None:  # refused here, not in a batch shared with other requests
            try:
                check_prefixes(translator, flat, encode_prefixes(vocab, flat_prefixes), decode,
                               shortlist=translator.shortlist)
            except UserError as err:
                raise HTTPException(422, str(err)) from None
        flat_phrases = [None] * len(flat)
        if constraints is not None:
            from aiayn.decoding.constraints import spread_over_parts

            flat_phrases = [tuple(ps) if ps else None
                            for ps in spread_over_parts(constraints, counts)]
        try:  # each line travels with its prefix and constraints (the batch mixes requests)
            results, batch_lines = await batcher().submit(
                list(zip(flat, flat_prefixes, flat_phrases)), key)
        except QueueFullError as err:
            raise HTTPException(429, str(err), headers={"Retry-After": "1"}) from None
        except ShuttingDownError as err:
            raise HTTPException(503, str(err)) from None
        if given is not None:  # a split line's parts are aligned as the model read them
            flat = [p for ps in parts for p in ps]
            sent = [given[n] if len(ps) == 1 else p for n, ps in enumerate(parts) for p in ps]
            results = await asyncio.get_running_loop().run_in_executor(
                model_thread, translator.with_alignments, sent, flat, results)
        return join_parts(results, counts), counts, batch_lines

    @app.post("/document")
    async def document(req: DocumentRequest):
        check_chars(req.text, "text")
        doc = segment(req.text, req.lang or config.data.src_lang)
        if not doc.spans:
            raise HTTPException(422, "text is empty: give at least one sentence")
        sources = doc.sentences
        key = (*search_settings(req.beam, req.alpha), guard_key(req), False)
        results, parts, batch_lines = await decode_in_parts(translator.preprocess(sources),
                                                            key, req.lang)
        texts = [ts[0].text for ts in results]
        return {"text": doc.rejoin(texts),
                "sentences": [{"source": src, "translation": ts[0].text, "paragraph": p + 1,
                               "parts": k, **quality_json(ts[0])}
                              for src, ts, p, k in zip(sources, results, doc.paragraphs, parts)],
                "split": [n for n, k in enumerate(parts, 1) if k > 1],
                "beam": key[0], "alpha": key[1], "batch_lines": batch_lines,
                "warnings": warnings(sources)}

    @app.post("/attention")
    async def attention(req: AttentionRequest):
        if not req.source.strip():
            raise HTTPException(422, "source is empty")
        if req.target is not None and not req.target.strip():
            raise HTTPException(422, "target is empty: leave it out to use the model's output")
        check_chars(req.source, "source")
        source = translator.preprocess([req.source])[0]
        if not source.strip():  # e.g. control characters only, which Moses drops
            raise HTTPException(422, "source is empty as the model reads it (after its "
                                     f"{config.data.preprocess} preprocessing)")
        check_tokens(source, "source", limits.max_attention_tokens)
        target = None
        if req.target is not None:
            check_chars(req.target, "target")
            target = translator.preprocess([req.target], "tgt")[0]
            if not target.strip():
                raise HTTPException(422, "target is empty as the model reads it (after its "
                                         f"{config.data.preprocess} preprocessing)")
            check_tokens(target, "target", limits.max_attention_tokens)
        beam, alpha, _ = search_settings(req.beam, req.alpha)
        # the model's own output may be longer than the bound on what a client may send
        max_len_b = min(decode.max_len_b, limits.max_attention_tokens)
        try:
            maps = await asyncio.get_running_loop().run_in_executor(
                model_thread, lambda: translator.attention(
                    source, target, beam_size=beam, alpha=alpha, max_len_b=max_len_b,
                    preprocessed=True))
        except RuntimeError as err:
            if "shutdown" in str(err):
                raise HTTPException(503, "the server is shutting down") from None
            raise
        return {"source": req.source, **maps.to_json(),
                "warnings": warnings([req.source], "source: ")
                + ([] if req.target is None else warnings([req.target], "target: "))}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    def load() -> dict:
        """What the server holds now: POST requests being answered, lines waiting for a
        batch, batches decoded since it started (all 0 before the app has started)."""
        b = state.get("batcher")
        queued, runs = (b.queued_lines, b.batches_run) if b is not None else (0, 0)
        return {"requests_in_flight": in_flight.requests, "queued_lines": queued,
                "batches_run": runs}

    @app.get("/info")
    async def info():
        return {"model": asdict(config.model),
                "parameters": count_parameters(translator.models[0]),
                "vocab_size": len(vocab),
                "checkpoint": translator.source[0] if translator.source else None,
                "ensemble": translator.source if len(translator.models) > 1 else None,
                "precision": translator.precision.chosen,
                "decode": {"beam": decode.beam_size, "alpha": decode.alpha,
                           "max_len_a": decode.max_len_a, "max_len_b": decode.max_len_b,
                           "beam_rules": decode.beam_rules, **guard_settings(decode)},
                "shortlist": None if translator.shortlist is None else
                {"path": translator.shortlist.source,
                 "always": int(translator.shortlist.always.numel()),
                 "pairs": int(translator.shortlist.targets.numel())},
                # the length_ratio flag's validation range; null: that flag is unchecked
                "length_ratio": None if translator.length_range is None
                else translator.length_range.to_record(),
                "limits": asdict(limits), "load": load(),
                "workers": 1 if pool is None else pool.workers}

    page = resources.files("aiayn.serve").joinpath("static/index.html").read_text("utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return page

    def begin_shutdown() -> None:
        """Close the batcher's windows at once (:meth:`Batcher.flush`); a no-op before the app
        has started. Safe to call from a signal handler."""
        if "batcher" in state:
            state["batcher"].flush()

    app.state.limits = limits
    app.state.workers = workers
    app.state.batcher = batcher
    app.state.begin_shutdown = begin_shutdown
    return app


__all__ = ["ServeLimits", "create_app"]
