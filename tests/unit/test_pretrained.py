"""aiayn.pretrained.load_pretrained, the one loader: the config it returns carries the run's
choice on val (its generation record's search settings) for the run and for any checkpoint the
run keeps, and the recorded decoding precision for the model the run chose only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from serving import tiny_checkpoint  # noqa: E402

from aiayn.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from aiayn.config import DecodeConfig  # noqa: E402
from aiayn.model import Transformer  # noqa: E402
from aiayn.pretrained import load_pretrained  # noqa: E402
from aiayn.rundir import RunDir  # noqa: E402


CHOSEN = DecodeConfig(beam_size=2, alpha=1.3, max_len_b=6)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> RunDir:
    """A finished run: ``averaged`` chosen on val at beam 2, alpha 1.3, int8; ``best`` and a
    step checkpoint kept beside it (random weights of one config and vocabulary)."""
    run = RunDir(tmp_path_factory.mktemp("pretrained") / "run")
    tiny_checkpoint(run.averaged)
    _, cfg, vocab = load_checkpoint(run.averaged)
    for seed, path in ((1, run.best), (2, run.step(10))):
        torch.manual_seed(seed)
        save_checkpoint(path, Transformer(cfg.model), cfg, vocab)
    run.train_summary.write_text("{}")
    run.write_generation([run.averaged], CHOSEN, precision="int8")
    return run


def test_a_run_loads_with_its_chosen_search_and_precision(run):
    own = load_checkpoint(run.averaged)[1].decode
    assert own.alpha != 1.3  # the checkpoint's own settings differ from the run's choice
    for path in (run.path, run.averaged, run.averaged / "model.safetensors"):
        loaded = load_pretrained(path, "cpu", print)
        assert loaded.sources == [str(run.averaged)], path
        assert loaded.config.decode == CHOSEN
        assert loaded.precision == "int8" and loaded.record["precision"] == "int8"


def test_another_checkpoint_of_the_run_gets_its_search_but_not_its_int8(run):
    """int8 was checked on val for the chosen model only; another checkpoint of the run
    decodes in fp32, with the run's alpha and beam."""
    for path in (run.best, run.step(10)):
        loaded = load_pretrained(path, torch.device("cpu"), print)
        assert loaded.sources == [str(path)]
        assert (loaded.config.decode.alpha, loaded.config.decode.beam_size) == (1.3, 2)
        assert loaded.precision == "fp32"
    from aiayn import Translator

    translator = Translator.from_pretrained(run.best)
    assert translator.decode_config.alpha == 1.3 and translator.precision.chosen == "fp32"


def test_a_checkpoint_of_no_run_keeps_its_own_settings(run, tmp_path):
    model, cfg, vocab = load_checkpoint(run.best)
    alone = save_checkpoint(tmp_path / "alone", model, cfg, vocab)
    loaded = load_pretrained(alone, "cpu", print)
    assert loaded.config.decode == cfg.decode and loaded.record == {}
    assert loaded.precision == "fp32"
