"""Typed, validated configuration: presets mirror Table 3; bad values fail at construction."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from aiayn.config import (
    Config,
    ConfigError,
    DataConfig,
    DecodeConfig,
    ModelConfig,
    TrainConfig,
    batch_tokens_per_process,
    load_config,
    preset_names,
)

# Table 3 rows: the model/train fields each row changes from base (blank cells = base, §6.2)
TABLE3_ROWS = {
    "table3-A1": {"h": 1, "d_k": 512, "d_v": 512},
    "table3-A2": {"h": 4, "d_k": 128, "d_v": 128},
    "table3-A3": {"h": 16, "d_k": 32, "d_v": 32},
    "table3-A4": {"h": 32, "d_k": 16, "d_v": 16},
    "table3-B1": {"d_k": 16},
    "table3-B2": {"d_k": 32},
    "table3-C1": {"N": 2},
    "table3-C2": {"N": 4},
    "table3-C3": {"N": 8},
    "table3-C4": {"d_model": 256, "d_k": 32, "d_v": 32},
    "table3-C5": {"d_model": 1024, "d_k": 128, "d_v": 128},
    "table3-C6": {"d_ff": 1024},
    "table3-C7": {"d_ff": 4096},
    "table3-D1": {"P_drop": 0.0},
    "table3-D2": {"P_drop": 0.2},
    "table3-D3": {"epsilon_ls": 0.0},
    "table3-D4": {"epsilon_ls": 0.2},
    "table3-E": {"positional": "learned"},
    # §6.1: big averages the last 20 checkpoints, 10 minutes (600 of its 1.0 s updates) apart
    "big": {"d_model": 1024, "d_ff": 4096, "h": 16, "P_drop": 0.3, "max_steps": 300_000,
            "keep_last": 20, "checkpoint_every_steps": 600},
}


def fields_of(cfg: Config) -> dict:
    return {**cfg.to_dict()["model"], **cfg.to_dict()["train"]}


def test_every_table3_preset_is_shipped():
    names = set(preset_names())
    assert {"base", "tiny", "multi30k", *TABLE3_ROWS} <= names


def test_the_ensemble_member_is_multi30k_with_a_wider_feed_forward_layer():
    """The main job's member preset changes one cell of ``multi30k`` (and its name): a recipe
    change to ``multi30k`` must reach the ensemble too."""
    member, single = load_config("multi30k-ensemble").to_dict(), load_config("multi30k").to_dict()
    assert member["model"].pop("d_ff") == 1024 and single["model"].pop("d_ff") == 512
    member.pop("name"), single.pop("name")
    assert member == single


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads(name):
    cfg = load_config(name)
    assert cfg.name == name
    assert isinstance(cfg.model, ModelConfig) and isinstance(cfg.train, TrainConfig)


def test_base_preset_is_the_paper_base_model():
    cfg = load_config("base")
    m, t, d = cfg.model, cfg.train, cfg.decode
    assert (m.N, m.d_model, m.d_ff, m.h, m.d_k, m.d_v) == (6, 512, 2048, 8, 64, 64)  # §3, Table 3
    assert (m.P_drop, t.epsilon_ls, t.warmup_steps) == (0.1, 0.1, 4000)  # §5.3-5.4
    assert (t.adam_beta1, t.adam_beta2, t.adam_eps) == (0.9, 0.98, 1e-9)  # §5.3
    assert (m.vocab_size, m.share_embeddings, m.positional, m.norm) == \
        (37000, True, "sinusoidal", "post")  # §3.4, §3.5, §3.1
    assert (d.beam_size, d.alpha, d.max_len_a, d.max_len_b) == (4, 0.6, 1.0, 50)  # §6.1
    assert t.max_steps == 100_000 and t.keep_last == 5
    # §6.1's checkpoints 10 minutes apart: 1,400 updates at §5.2's 0.43 s an update (100,000 in
    # 12 hours), in updates so that the averaged span is the paper's on any machine
    assert (t.checkpoint_every_steps, t.checkpoint_every_s) == (1400, 0)
    assert (t.precision, t.tf32) == ("auto", True)
    # §5.1's ~25000 tokens a side is one update's, however many processes share it
    assert (cfg.data.global_max_tokens, cfg.data.max_tokens) == (25000, 0)
    assert batch_tokens_per_process(cfg.data, 1, 1) == 25000
    assert batch_tokens_per_process(cfg.data, 8, 1) == 3125


def test_global_batch_is_shared_out_over_processes_and_accumulation():
    d = DataConfig(global_max_tokens=25000, max_tokens=0)
    assert [batch_tokens_per_process(d, w, a) for w, a in ((1, 1), (2, 2), (4, 1), (1, 4))] == \
        [25000, 6250, 6250, 6250]
    assert batch_tokens_per_process(d, 3, 1) == 8333  # rounded down: never above the global
    # a per-process figure that agrees is accepted (a resumed run's config.json holds one)
    assert batch_tokens_per_process(replace(d, max_tokens=3125), 8, 1) == 3125
    assert batch_tokens_per_process(DataConfig(max_tokens=2048), 8, 4) == 2048  # no global
    with pytest.raises(ConfigError, match=r"data.max_tokens=2048 and "
                                          r"data.global_max_tokens=25000 disagree: over 2 "
                                          r"process\(es\) x train.accum_steps=1 the global batch "
                                          r"gives 12500"):
        batch_tokens_per_process(replace(d, max_tokens=2048), 2, 1)
    with pytest.raises(ConfigError, match="leaves no token"):
        batch_tokens_per_process(DataConfig(global_max_tokens=3, max_tokens=0), 2, 2)
    with pytest.raises(ConfigError, match="max_tokens = 0 .* needs data.global_max_tokens"):
        DataConfig(max_tokens=0)
    with pytest.raises(ConfigError, match="vocab_sample_lines"):
        DataConfig(vocab_sample_lines=-1)


@pytest.mark.parametrize("name", sorted(TABLE3_ROWS))
def test_table3_row_changes_only_its_cells(name):
    """``extends = "base.toml"`` inherits everything the row leaves blank."""
    base, row = fields_of(load_config("base")), fields_of(load_config(name))
    changed = {k: v for k, v in row.items() if base[k] != v}
    assert changed == TABLE3_ROWS[name]
    assert load_config(name).data == load_config("base").data


def test_rows_A_keep_computation_constant():
    for name in ("table3-A1", "table3-A2", "table3-A3", "table3-A4"):
        m = load_config(name).model
        assert m.h * m.d_k == m.h * m.d_v == m.d_model


# --- impossible configurations --------------------------------------------------------------

@pytest.mark.parametrize("cls, field, value", [
    (ModelConfig, "N", 0),
    (ModelConfig, "d_model", -512),
    (ModelConfig, "d_ff", 0),
    (ModelConfig, "h", -1),
    (ModelConfig, "d_k", 0),
    (ModelConfig, "vocab_size", 0),
    (ModelConfig, "max_len", 0),
    (ModelConfig, "P_drop", 1.0),
    (ModelConfig, "P_drop", -0.1),
    (ModelConfig, "attention_dropout", 1.5),
    (ModelConfig, "word_dropout", 1.0),
    (ModelConfig, "positional", "rotary"),
    (ModelConfig, "norm", "sandwich"),
    (ModelConfig, "pad_id", 37000),
    (ModelConfig, "N", 2.5),  # wrong types
    (ModelConfig, "N", "6"),
    (ModelConfig, "d_model", True),
    (ModelConfig, "share_embeddings", "no"),
    (ModelConfig, "P_drop", "0.1"),
    (DataConfig, "max_tokens", 0),
    (DataConfig, "vocab_kind", "unigram"),
    (DataConfig, "dataset", 3),
    (TrainConfig, "warmup_steps", 0),
    (TrainConfig, "epsilon_ls", 1.0),
    (TrainConfig, "adam_beta2", 1.2),
    (TrainConfig, "clip_norm", -1.0),
    (TrainConfig, "precision", "fp8"),
    (DecodeConfig, "beam_size", 0),
    (DecodeConfig, "alpha", -0.6),
])
def test_impossible_value_raises_naming_field_and_value(cls, field, value):
    with pytest.raises(ValueError) as err:
        cls(**{field: value})
    assert field in str(err.value) and repr(value) in str(err.value)


def test_tying_needs_one_shared_vocabulary():
    with pytest.raises(ValueError, match="tgt_vocab_size=900"):
        ModelConfig(vocab_size=1000, tgt_vocab_size=900, share_embeddings=True)
    m = ModelConfig(vocab_size=1000, tgt_vocab_size=900, share_embeddings=False)
    assert m.target_vocab_size == 900
    assert ModelConfig(vocab_size=1000).target_vocab_size == 1000


def test_int_for_a_float_field_is_stored_as_float():
    m = ModelConfig(P_drop=0)
    assert m.P_drop == 0.0 and isinstance(m.P_drop, float)


def test_config_sections_must_have_their_types():
    with pytest.raises(ValueError, match="Config.model"):
        Config(model=TrainConfig())


def test_unknown_preset_names_it_and_lists_the_known_ones():
    with pytest.raises(ValueError) as err:
        load_config("table3-Z9")
    assert "table3-Z9" in str(err.value) and "table3-C1" in str(err.value)


def test_missing_config_file():
    with pytest.raises(FileNotFoundError):
        load_config("/nonexistent/run.toml")


@pytest.mark.parametrize("text, names", [
    ("[model]\nN = 2\nlayers = 3\n", ["layers"]),
    ("[modle]\nN = 2\n", ["modle"]),
    ("[model]\nN = \"six\"\n", ["N", "'six'"]),
    ("[model]\nN = 2.5\n", ["N", "2.5"]),
    ("[model]\nd_model = true\n", ["d_model", "True"]),
    ("[train]\nepsilon_ls = 1.5\n", ["epsilon_ls", "1.5"]),
    ("[model]\nN = \n", ["TOML"]),
])
def test_bad_config_file_names_the_offender(tmp_path, text, names):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_config(str(path))
    for name in names:
        assert name in str(err.value)


def test_extends_merges_sections_field_by_field(tmp_path):
    (tmp_path / "parent.toml").write_text(
        "[model]\nN = 3\nd_model = 128\nd_k = 16\nd_v = 16\n[train]\nwarmup_steps = 10\n")
    (tmp_path / "child.toml").write_text('extends = "parent.toml"\n[model]\nN = 1\n')
    cfg = load_config(str(tmp_path / "child.toml"))
    assert cfg.name == "child"
    assert (cfg.model.N, cfg.model.d_model, cfg.model.d_k) == (1, 128, 16)
    assert cfg.train.warmup_steps == 10
    (tmp_path / "grandchild.toml").write_text('extends = "child.toml"\n')
    with pytest.raises(ValueError, match="one level"):
        load_config(str(tmp_path / "grandchild.toml"))


def test_saved_json_round_trips(tmp_path):
    cfg = load_config("table3-E", ["model.tgt_vocab_size=none", "train.precision=bf16"])
    assert Config.from_dict(json.loads(cfg.to_json())) == cfg
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    assert load_config(str(path)) == cfg


# --- --set overrides ------------------------------------------------------------------------

def test_overrides_are_parsed_by_field_type():
    cfg = load_config("base", ["model.N=4", "model.P_drop=0.3", "model.share_embeddings=false",
                               "model.positional=learned", "decode.beam_size=8"])
    assert cfg.model.N == 4 and isinstance(cfg.model.N, int)
    assert cfg.model.P_drop == 0.3
    assert cfg.model.share_embeddings is False
    assert cfg.model.positional == "learned" and cfg.decode.beam_size == 8
    assert load_config("base").model.N == 6  # presets are not mutated
    assert Config().with_overrides(["train.lr_scale=2"]).train.lr_scale == 2.0


@pytest.mark.parametrize("override, words", [
    ("model.N=four", ["model.N", "'four'"]),
    ("model.N=2.5", ["model.N", "'2.5'"]),
    ("model.share_embeddings=maybe", ["model.share_embeddings", "'maybe'"]),
    ("model.P_drop=high", ["model.P_drop", "'high'"]),
    ("model.N=0", ["N", "0"]),
    ("model.P_drop=1.0", ["P_drop", "1.0"]),
    ("model.layers=3", ["model.layers"]),
    ("optim.lr=3", ["optim"]),
    ("model.N", ["model.N"]),
    ("N=3", ["N=3"]),
])
def test_bad_override_is_rejected(override, words):
    with pytest.raises(ValueError) as err:
        load_config("tiny", [override])
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("bf16, weights, precision", [
    (False, False, "fp32"), (True, False, "bf16"), (True, True, "bf16-weights")])
def test_a_run_written_before_train_precision_loads_with_the_precision_it_meant(
        tmp_path, bf16, weights, precision):
    data = load_config("multi30k").to_dict()
    del data["train"]["precision"]
    data["train"].update(bf16=bf16, bf16_weights=weights)  # as config.json files held them
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    assert load_config(str(path)).train.precision == precision
    data["train"]["precision"] = "fp32"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="train.precision alone"):
        load_config(str(path))


def test_fp16_and_full_float32_products_can_be_asked_for():
    cfg = load_config("base", ["train.precision=fp16", "train.tf32=false"])
    assert (cfg.train.precision, cfg.train.tf32) == ("fp16", False)
    with pytest.raises(ValueError, match="tf32"):
        load_config("base", ["train.tf32=maybe"])


def test_the_old_bf16_override_names_its_successor():
    with pytest.raises(ValueError, match=r"train.bf16_weights is now train.precision \(one of "
                                         r"auto, fp32, bf16, bf16-weights, fp16\)"):
        load_config("multi30k", ["train.bf16_weights=true"])
    assert load_config("multi30k", ["train.precision=fp32"]).train.precision == "fp32"
    assert load_config("multi30k").train.precision == "auto"
    assert load_config("tiny").train.precision == "fp32"
