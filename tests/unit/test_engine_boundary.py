"""The line between the paper's model and decoding's engine (issue 80): ``model/transformer.py``
is §3 in torch, with no kernel and no attribute another module sets, and one ``decode_step``
that returns logits; the searches drive the declared step protocol and never probe a step; a
new search rule is a score processor, not a change to the model or the steps."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from test_search import SOURCES, tiny_model  # tests/unit is on sys.path

from aiayn.data.vocab import EOS_ID
from aiayn.decoding import search
from aiayn.decoding.search import (
    CachedStep,
    EnsembleStep,
    SearchState,
    StepFunction,
    UncachedStep,
    beam_search,
    greedy_search,
)
from aiayn.model.engine import CpuEngine, Int8Transformer, as_engine
from aiayn.model.quantize import quantize_int8

SRC = Path(__file__).resolve().parents[2] / "src" / "aiayn"


def test_the_model_file_names_no_kernel():
    text = (SRC / "model" / "transformer.py").read_text(encoding="utf-8")
    assert "kernels" not in text


def test_the_searches_never_probe_a_step():
    text = (SRC / "decoding" / "search.py").read_text(encoding="utf-8")
    assert "getattr(" not in text and "hasattr(" not in text
    assert "isinstance(found" not in text


def test_every_step_function_declares_the_protocol():
    from aiayn.decoding.shortlist import ShortlistStep
    from aiayn.parsing.decode import ConstrainedStep

    for cls in (CachedStep, UncachedStep, EnsembleStep, ShortlistStep, ConstrainedStep):
        assert StepFunction in cls.__mro__, cls  # subclassed, not only matched
        assert callable(cls.log_probs) and callable(cls.greedy)


def _attributes_set_on_self(cls_name: str) -> set[str]:
    """The names ``self.NAME = ...`` assigns in ``cls_name``'s methods (transformer.py)."""
    tree = ast.parse((SRC / "model" / "transformer.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return names


def test_no_module_sets_the_models_attributes():
    """No module of the package assigns an attribute of a Transformer (or of its attention)
    that the class does not set itself, the way int8 slots were once filled from outside;
    and decoding a model, in fp32 or through its int8 copy, leaves every attribute as it was."""
    declared = _attributes_set_on_self("Transformer") | _attributes_set_on_self(
        "MultiHeadAttention")
    outside = []
    for path in SRC.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if path.name == "transformer.py" or "aiayn.model" not in text:  # (tokenizers have
            continue  # decoders too: only a module that reaches the model could set its own)
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and node.attr in declared and node.attr not in ("record_weights",
                                                                    "weights", "active")
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                outside.append(f"{path.relative_to(SRC)}:{node.lineno}: .{node.attr}")
    assert not outside, outside
    model = tiny_model(60, seed=3)
    before = dict(vars(model))
    modules = [(name, type(m)) for name, m in model.named_modules()]
    with torch.no_grad():
        for m in (model, quantize_int8(model)):
            greedy_search(CachedStep.start(m, *as_engine(m).encode(_src())), torch.tensor([4] * 4))
    assert dict(vars(model)) == before
    assert [(name, type(m)) for name, m in model.named_modules()] == modules


def _src() -> torch.Tensor:
    from aiayn.data.batching import pad_sources

    return pad_sources(SOURCES)


@pytest.mark.parametrize("kind", ["model", "engine", "int8"])
def test_decode_step_has_one_signature_and_returns_logits(kind):
    model = tiny_model(60, seed=3)
    m = {"model": model, "engine": CpuEngine(model), "int8": quantize_int8(model)}[kind]
    params = list(inspect.signature(m.decode_step).parameters)
    assert params == ["tokens", "cache"]
    with torch.no_grad():
        memory, mask = m.encode(_src())
        cache = m.start_cache(memory, mask)
        tgt = torch.tensor([[1, 5, 6]] * 4)
        out = m.decode_step(tgt[:, :1], cache)
        out2 = m.decode_step(tgt[:, 1:], cache)
        full = model.decode(tgt, *model.encode(_src()))
    assert type(out) is torch.Tensor and out.shape == (4, 1, 60) and out2.shape == (4, 2, 60)
    # logits: the model's own (the engine's to float rounding, the int8 copy's roughly)
    tol = 1e-4 if kind != "int8" else 0.1 * float(full.abs().max())
    torch.testing.assert_close(torch.cat([out, out2], 1), full, atol=tol, rtol=0)


def test_the_engine_decodes_as_the_model_and_an_int8_copy_is_an_engine():
    model = tiny_model(60, seed=3)
    with torch.no_grad():
        model.tgt_embed.weight.mul_(4.0)  # peaked distributions: the same argmax
    assert isinstance(quantize_int8(model), Int8Transformer)
    assert as_engine(model).model is model
    lens = torch.tensor([7, 3, 12, 5])
    with torch.no_grad():
        outs = []
        for m, engine in ((model, model), (model, as_engine(model))):
            step = CachedStep.start(m, *engine.encode(_src()), 13)
            outs.append([h.tokens for h in greedy_search(step, lens)])
        uncached = UncachedStep.start(model, *model.encode(_src()))
        outs.append([h.tokens for h in greedy_search(uncached, lens)])
    assert outs[0] == outs[1] == outs[2]


class BanToken:
    """A score processor of the test's own: the token ``token`` is never chosen."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, logp: torch.Tensor, state: SearchState) -> torch.Tensor:
        logp[:, self.token] = float("-inf")
        return logp


@pytest.mark.parametrize("int8", [False, True])
def test_a_new_search_rule_is_a_processor(int8):
    """A processor the searches were never written for changes what they choose, through the
    steps' declared methods (an int8 step's greedy kernel steps aside for it), and without it
    the step's own kernel and the protocol's default give the same tokens."""
    model = tiny_model(60, seed=3)
    with torch.no_grad():
        model.tgt_embed.weight.mul_(4.0)
    m = quantize_int8(model) if int8 else model
    lens = torch.tensor([7, 3, 12, 5])

    def run(processors=(), beam=1):
        with torch.no_grad():
            step = CachedStep.start(m, *as_engine(m).encode(_src()), 13)
            if beam == 1:
                return [h.tokens for h in greedy_search(step, lens, processors=processors)]
            return [h[0].tokens for h in beam_search(step, lens, beam_size=beam,
                                                     processors=processors)]

    for beam in (1, 3):
        plain = run(beam=beam)
        common = max(((t, sum(s.count(t) for s in plain)) for t in range(EOS_ID + 1, 60)),
                      key=lambda x: x[1])[0]
        banned = run((BanToken(common),), beam)
        assert any(common in s for s in plain)
        assert not any(common in s for s in banned) and banned != plain
    # the default greedy (log_probs, the rules, argmax) against the step's own
    assert search.StepFunction.greedy is not CachedStep.greedy


def test_the_length_rules_are_a_processor():
    rules = search.LengthRules(min_len=2)
    logp = torch.zeros(3, 6)
    state = SearchState(1, torch.tensor([1, 5, 5]))
    out = rules(logp.clone(), state)
    assert torch.isinf(out[:, :2]).all()  # PAD and BOS never
    assert out[0].tolist() == [float("-inf")] * 6  # at its limit only EOS, banned before min_len
    assert torch.isinf(out[1:, EOS_ID]).all() and (out[1:, 3:] == 0).all()
    banned, only = rules.eos_masks(state)
    assert banned.tolist() == [True] * 3 and only.tolist() == [True, False, False]
    assert search.LengthRules(free_forced_eos=True).eos_masks(state) is None
