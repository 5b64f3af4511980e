"""``aiayn serve``'s JSON API over real HTTP (uvicorn on 127.0.0.1, httpx as the client), on a
tiny random-weight checkpoint: every status code it answers (200, 404, 405, 413, 422, 429,
503), that concurrent requests share a batch, that answers equal a ``Translator``'s
``generate`` and ``attention`` called directly, and that SIGTERM lets the request in flight
finish."""

from __future__ import annotations

import dataclasses
import signal
import threading
import time

import httpx
import pytest
from serving import serve_in_thread, serve_process, tiny_checkpoint

from aiayn.checkpoint import load_checkpoint
from aiayn.decoding.workers import fork_available
from aiayn.serve import ServeLimits, create_app
from aiayn.translator import Translator


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("serve") / "ckpt")


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_checkpoint(checkpoint)


@pytest.fixture(scope="module")
def url(loaded):
    model, config, vocab = loaded
    limits = ServeLimits(max_body_bytes=4000, max_lines=4, max_chars=200,
                         max_attention_tokens=20, max_batch_lines=8, max_wait_ms=5, max_beam=5)
    with serve_in_thread(create_app(Translator(model, vocab, config=config), limits)) as base:
        yield base


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, timeout=30, **kw)


def get(url, path, **kw):
    """A GET with the posts' 30 s timeout: httpx's default 5 s timed out once on the first
    request, with the whole suite running on 2 cores."""
    return httpx.get(url + path, timeout=30, **kw)


def test_health_info_page_and_unknown_paths(url, loaded):
    model, config, vocab = loaded
    assert get(url, "/health").json() == {"status": "ok"}
    info = get(url, "/info").json()
    assert info["model"]["N"] == config.model.N and info["model"]["h"] == config.model.h
    assert info["vocab_size"] == len(vocab)
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    assert info["limits"]["max_lines"] == 4
    assert info["shortlist"] is None
    assert info["length_ratio"] is None  # a bare checkpoint: the flag is unchecked
    page = get(url, "/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert 'id="translate"' in page.text
    assert get(url, "/nowhere").status_code == 404
    assert get(url, "/translate").status_code == 405


def test_translate_answers_what_the_translator_gives(url, loaded):
    model, _, vocab = loaded
    lines = ["Two dogs play in the snow.", "A man rides a bike."]
    r = post(url, "/translate", {"lines": lines, "beam": 3, "alpha": 0.6, "nbest": 2})
    assert r.status_code == 200
    data = r.json()
    direct = Translator(model, vocab, precision="fp32").generate(
        lines, beam_size=3, alpha=0.6, nbest=2, max_len_a=0.5, max_len_b=6)
    assert [[t["text"] for t in line] for line in data["translations"]] == \
        [[t.text for t in line] for line in direct]
    for got, want in zip(data["translations"], direct):
        for g, w in zip(got, want):
            assert g["score"] == pytest.approx(w.score, abs=1e-5)
            assert g["log_prob"] == pytest.approx(w.log_prob, abs=1e-5)
            assert g["confidence"] == pytest.approx(w.confidence, abs=1e-5)
            assert g["flags"] == list(w.flags) and g["unchecked"] == ["length_ratio"]
    assert (data["beam"], data["alpha"], data["nbest"]) == (3, 0.6, 2)
    greedy = post(url, "/translate", {"lines": lines[:1], "beam": 1}).json()
    assert greedy["translations"][0][0]["score"] == greedy["translations"][0][0]["log_prob"]


@pytest.mark.skipif(not fork_available(), reason="needs fork")
def test_two_decoding_processes_answer_what_the_translator_gives(loaded):
    model, config, vocab = loaded
    limits = ServeLimits(max_lines=2, max_batch_lines=2, max_wait_ms=5)
    app = create_app(Translator(model, vocab, config=config, workers=2), limits)
    assert app.state.workers == 2
    lines = ["Two dogs play in the snow.", "A man rides a bike.", "A red shirt.",
             "Zwei Hunde spielen.", "A dog.", "Two men ride bikes in the snow."]
    with serve_in_thread(app) as base:
        assert get(base, "/info").json()["workers"] == 2
        asked = [in_thread(lambda pair=lines[i : i + 2]: post(base, "/translate",
                                                              {"lines": pair, "beam": 3}))
                 for i in range(0, len(lines), 2)]
        for t, _ in asked:
            t.join(timeout=60)
        att = post(base, "/attention", {"source": lines[0]})
    got = []
    for _, box in asked:
        assert box["r"].status_code == 200, box["r"].text
        got += [line[0] for line in box["r"].json()["translations"]]
    direct = Translator(model, vocab, config=config).generate(lines, beam_size=3)
    assert [g["text"] for g in got] == [d[0].text for d in direct]
    for g, d in zip(got, direct):
        assert g["score"] == pytest.approx(d[0].score, abs=1e-5)
    assert att.status_code == 200 and att.json()["attention"]["cross"]["shape"][0] == \
        config.model.N


def test_input_tokenized_already_is_translated_with_a_warning(url, loaded):
    """A model that tokenizes its input itself (lc-norm-tok) answers lines that hold Moses
    escapes with a warning, from both endpoints, and still translates them; raw lines, and a
    model that reads raw text, get none."""
    model, config, vocab = loaded
    lc = dataclasses.replace(config, data=dataclasses.replace(config.data,
                                                               preprocess="lc-norm-tok"))
    with serve_in_thread(create_app(Translator(model, vocab, config=lc))) as base:
        r = post(base, "/translate", {"lines": ["a man &apos;s dog .", "A man's dog."],
                                      "beam": 1})
        assert r.status_code == 200
        data = r.json()
        assert len(data["translations"]) == 2
        assert len(data["warnings"]) == 1
        assert "1 of 2 input lines (line 1 first)" in data["warnings"][0]
        assert post(base, "/translate", {"lines": ["A man's dog."]}).json()["warnings"] == []
        att = post(base, "/attention", {"source": "A man's dog.",
                                        "target": "ein hund &quot; ."})
        assert att.status_code == 200
        assert [w.split(":")[0] for w in att.json()["warnings"]] == ["target"]
    raw = post(url, "/translate", {"lines": ["a man &apos;s dog ."], "beam": 1}).json()
    assert raw["warnings"] == [] and len(raw["translations"]) == 1


def test_attention_answers_every_layer_and_head(url, loaded):
    model, config, vocab = loaded
    r = post(url, "/attention", {"source": "Two dogs play.", "target": "Zwei Hunde spielen."})
    assert r.status_code == 200
    data = r.json()
    N, h = config.model.N, config.model.h
    S, T = len(data["source_tokens"]), len(data["target_outputs"])
    shapes = {k: v["shape"] for k, v in data["attention"].items()}
    assert shapes == {"encoder": [N, h, S, S], "decoder": [N, h, T, T], "cross": [N, h, T, S]}
    direct = Translator(model, vocab, precision="fp32").attention("Two dogs play.",
                                                                  "Zwei Hunde spielen.")
    assert data["attention"]["cross"]["weights"] == direct.to_json()["attention"]["cross"][
        "weights"]
    own = post(url, "/attention", {"source": "Two dogs play."}).json()
    assert own["forced"] is False
    assert own["target"] == post(url, "/translate", {"lines": ["Two dogs play."]}).json()[
        "translations"][0][0]["text"]


def wait_for_load(base, **want):
    """Poll ``GET /info`` until its ``load`` has every figure in ``want`` (60 s at most): the
    tests wait for the server's own account of what it holds, not for a guessed sleep, so a
    loaded host that schedules a client thread late cannot reorder them."""
    deadline = time.monotonic() + 60
    while True:
        load = httpx.get(base + "/info", timeout=30).json()["load"]
        if all(load[k] == v for k, v in want.items()):
            return load
        assert time.monotonic() < deadline, f"the server's load stayed {load}, not {want}"
        time.sleep(0.05)


def in_thread(fn):
    """Start ``fn()`` on a thread; returns (thread, box), where ``box["r"]`` is its result once
    the thread has ended (absent if it has not, or if ``fn`` raised)."""
    box = {}
    thread = threading.Thread(target=lambda: box.update(r=fn()))
    thread.start()
    return thread, box


def test_info_reports_the_load(url):
    before = wait_for_load(url, requests_in_flight=0, queued_lines=0)
    post(url, "/translate", {"lines": ["Two dogs.", "A man."]})
    after = wait_for_load(url, requests_in_flight=0, queued_lines=0)
    assert after["batches_run"] == before["batches_run"] + 1


def test_concurrent_requests_are_decoded_as_one_batch(loaded):
    model, config, vocab = loaded
    # The window (60 s) is far longer than the test: a batch starts only when it is full
    # (8 lines, 4 x 2 here) or when the server closes its windows (begin_shutdown, on SIGTERM).
    limits = ServeLimits(max_lines=2, max_batch_lines=8, max_wait_ms=60_000)
    app = create_app(Translator(model, vocab, config=config), limits)
    with serve_in_thread(app) as base:
        two = [in_thread(lambda: post(base, "/translate", {"lines": ["A man.", "A dog."]}))
               for _ in range(4)]
        for t, _ in two:
            t.join(timeout=30)
        one = []
        for i in range(4):
            one.append(in_thread(lambda i=i: post(base, "/translate",
                                                  {"lines": [f"Two dogs {i}."]})))
            wait_for_load(base, queued_lines=i + 1)  # one line more waits in the window
        app.state.begin_shutdown()  # closes the window: the 4 waiting lines are one batch
        for t, _ in one:
            t.join(timeout=30)
    results = [box["r"] for _, box in two + one]
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    assert [r.json()["batch_lines"] for r in results] == [8] * 4 + [4] * 4


@pytest.mark.parametrize("body, message", [
    ({"lines": ["x"] * 5}, "5 lines in one request; at most 4"),
    ({"lines": ["a dog " * 40]}, "line 1 has 240 characters; at most 200"),
])
def test_413_names_what_was_too_big(url, body, message):
    r = post(url, "/translate", body)
    assert r.status_code == 413 and message in r.json()["detail"], r.text


def test_413_for_a_line_over_the_model_max_len(url, loaded):
    vocab = loaded[2]
    line = "Two dogs " * 12  # 108 characters, more than max_len = 48 tokens
    n = len(vocab.encode(line)) + 1
    assert n > 48
    r = post(url, "/translate", {"lines": ["ok", line]})
    assert r.status_code == 413
    assert f"line 2 has {n} subword tokens with </s>; at most 48" in r.json()["detail"]


def test_413_counts_a_line_as_the_model_reads_it(loaded):
    """An lc-norm-tok model reads "dog's" as "dog &apos;s": a line under max_len as sent but
    over it once tokenized answers 413 naming the tokenized count, rather than failing the
    batch it would have joined (and every other request in it) with a 500."""
    from aiayn.data.text import model_text

    model, config, vocab = loaded
    lc = dataclasses.replace(config, data=dataclasses.replace(config.data,
                                                               preprocess="lc-norm-tok"))
    counts = {}
    for k in range(1, 30):
        line = " ".join(["a dog's ball."] * k)
        raw, read = (len(vocab.encode(line)) + 1,
                     len(vocab.encode(model_text([line], lc.data)[0])) + 1)
        if raw <= 48 < read:
            counts = {"line": line, "read": read}
            break
    assert counts, "no line is under max_len raw and over it tokenized"
    with serve_in_thread(create_app(Translator(model, vocab, config=lc))) as base:
        r = post(base, "/translate", {"lines": ["a dog.", counts["line"]], "beam": 1})
        assert r.status_code == 413, r.text
        assert (f"line 2 has {counts['read']} subword tokens with </s> after the model's "
                "lc-norm-tok preprocessing; at most 48") in r.json()["detail"]
        assert post(base, "/translate", {"lines": ["a dog's ball."]}).status_code == 200


def test_413_for_bodies_and_attention_inputs(url):
    big = {"lines": ["x" * 150] * 30}  # about 4.6 kB > 4000 bytes
    r = post(url, "/translate", big)
    assert r.status_code == 413
    assert "request body too large: at most 4000 bytes" in r.json()["detail"]
    chunks = (b'{"lines": ["' + b"x" * 100 + b'"' for _ in range(50))  # chunked, no length
    r = httpx.post(url + "/translate", content=chunks,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "got more than 4000" in r.json()["detail"]
    r = post(url, "/attention", {"source": "two dogs " * 20})
    assert r.status_code == 413 and "source has" in r.json()["detail"]
    assert "at most 20" in r.json()["detail"]


@pytest.mark.parametrize("path, body, message", [
    ("/translate", {}, "lines: Field required"),
    ("/translate", {"lines": "a dog"}, "lines: Input should be a valid list"),
    ("/translate", {"lines": ["a"], "beem": 4}, "beem: Extra inputs are not permitted"),
    ("/translate", {"lines": ["a"], "beam": 0}, "beam: Input should be greater than or equal"),
    ("/translate", {"lines": ["a"], "beam": 9}, "beam 9 is larger than this server allows"),
    ("/translate", {"lines": ["a"], "beam": 2, "nbest": 3}, "nbest 3 needs a beam"),
    ("/translate", {"lines": ["a"], "alpha": -1}, "alpha: Input should be greater than"),
    ("/translate", {"lines": []}, "lines is empty"),
    ("/translate", {"lines": ["a\nb"]}, "line 1 contains a line break"),
    ("/attention", {"source": " "}, "source is empty"),
    ("/attention", {"target": "x"}, "source: Field required"),
])
def test_422_says_what_is_wrong(url, path, body, message):
    r = post(url, path, body)
    assert r.status_code == 422 and message in r.json()["detail"], r.text


def test_422_for_a_body_that_is_not_json(url):
    r = httpx.post(url + "/translate", content=b"{lines:", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 422 and "JSON decode error" in r.json()["detail"]


def test_429_when_too_many_requests_are_in_flight(loaded):
    model, config, vocab = loaded
    limits = ServeLimits(max_concurrent=2, max_lines=1, max_batch_lines=4, max_wait_ms=60_000)
    app = create_app(Translator(model, vocab, config=config), limits)
    with serve_in_thread(app) as base:
        send = lambda: post(base, "/translate", {"lines": ["Two dogs."]})  # noqa: E731
        waiting = []
        for n in (1, 2):
            waiting.append(in_thread(send))
            wait_for_load(base, requests_in_flight=n, queued_lines=n)
        third = send()
        app.state.begin_shutdown()
        for t, _ in waiting:
            t.join(timeout=30)
        after = send()
    assert [box["r"].status_code for _, box in waiting] == [200, 200]
    assert third.status_code == 429
    assert "too many requests in flight: 2 are being answered (at most 2)" in \
        third.json()["detail"]
    assert third.headers["retry-after"] == "1"
    assert after.status_code == 200


def test_429_when_the_queue_is_full(loaded):
    model, config, vocab = loaded
    limits = ServeLimits(max_queue_lines=4, max_lines=3, max_batch_lines=8, max_wait_ms=60_000)
    app = create_app(Translator(model, vocab, config=config), limits)
    with serve_in_thread(app) as base:
        thread, first = in_thread(lambda: post(base, "/translate", {"lines": ["a", "b", "c"]}))
        wait_for_load(base, queued_lines=3)
        second = post(base, "/translate", {"lines": ["d", "e"]})
        app.state.begin_shutdown()
        thread.join(timeout=30)
    assert first["r"].status_code == 200 and second.status_code == 429
    assert "the queue is full: 3 lines are waiting and this request adds 2 (at most 4 may " \
        "wait)" in second.json()["detail"]


def test_shortlist_is_reported_and_used(loaded, tmp_path):
    """``aiayn serve --shortlist``: /info names the file and its size, and /translate answers
    what the Translator with that shortlist gives, every token on its sentence's list."""
    from fastapi.testclient import TestClient

    from aiayn.decoding.shortlist import Shortlist

    model, config, vocab = loaded
    lines = ["Two dogs play in the snow.", "A man rides a bike."]
    pairs = [(ids, ids[::-1]) for ids in vocab.encode_batch(lines * 3)]
    path = Shortlist.build(pairs, len(vocab), first=4, best=2).save(tmp_path / "vmap.txt", vocab)
    translator = Translator(model, vocab, config=config, shortlist=path)
    direct = translator.generate(lines, beam_size=2)
    with TestClient(create_app(translator)) as client:
        info = client.get("/info").json()["shortlist"]
        got = client.post("/translate", json={"lines": lines, "beam": 2}).json()
    assert info == {"path": str(path), "always": int(translator.shortlist.always.numel()),
                    "pairs": int(translator.shortlist.targets.numel())}
    assert 0 < info["always"] <= 4
    assert [t[0]["text"] for t in got["translations"]] == [t[0].text for t in direct]
    ids, allowed = translator.shortlist.candidates(
        vocab.encode_batch(translator.preprocess(lines)), 3, len(vocab))
    for b, line in enumerate(direct):  # every output token is on its own sentence's list
        assert set(line[0].tokens) <= set(ids[allowed[b]].tolist())


def test_503_once_the_batcher_has_stopped(loaded):
    from fastapi.testclient import TestClient

    model, config, vocab = loaded
    app = create_app(Translator(model, vocab, config=config))
    with TestClient(app) as client:
        assert client.post("/translate", json={"lines": ["a dog"]}).status_code == 200
        client.portal.call(app.state.batcher().stop)
        r = client.post("/translate", json={"lines": ["a dog"]})
    assert r.status_code == 503 and "shutting down" in r.json()["detail"]


@pytest.mark.parametrize("workers", ["1", pytest.param("2", marks=pytest.mark.skipif(
    not fork_available(), reason="needs fork"))])
def test_sigterm_finishes_the_request_in_flight(checkpoint, tmp_path, workers):
    # The request waits in a batch window (60 s) longer than the graceful timeout (20 s): it is
    # answered only if the signal closes the window, else uvicorn cancels it at the timeout.
    # With two decoding processes, they ignore the signal and end after the request.
    log = tmp_path / "serve.log"
    with serve_process(checkpoint, "--max-wait-ms", "60000", "--graceful-timeout-s", "20",
                       "--workers", workers, log=log) as (proc, base):
        thread, box = in_thread(lambda: post(base, "/translate", {"lines": ["Two dogs play."]}))
        wait_for_load(base, queued_lines=1)  # the request now waits in its batch window
        proc.send_signal(signal.SIGTERM)
        thread.join(timeout=60)
        rc = proc.wait(timeout=60)
    assert "r" in box, f"the request got no answer; the server log:\n{log.read_text()}"
    assert box["r"].status_code == 200 and box["r"].json()["translations"][0][0]["text"]
    assert rc == 0, log.read_text()
    where = "this process" if workers == "1" else "2 one-thread processes"
    assert f"decoding in {where}" in log.read_text()
    with pytest.raises(httpx.ConnectError):
        httpx.get(base + "/health", timeout=2)
