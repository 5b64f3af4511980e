"""The main job's shape rule (aiayn.budget) on stubbed throughputs: a fast machine gets an
ensemble, a slow one one model; the warmup and the dropout follow the projection; a budget too
short is refused with its minimum; a probe that cannot run falls back to a stated default."""

from __future__ import annotations

from dataclasses import replace

import pytest

from aiayn.budget import (CHECKPOINTS_PER_BUDGET, LOW_ATTENTION_DROPOUT, LOW_DROPOUT_EPOCHS,
                          LOW_P_DROP, MEMBER_PRESET, MIN_CHECKPOINT_EVERY_S, MIN_UPDATES,
                          SINGLE_PRESET, TARGET_EPOCHS, WARMUP_SHARE, Candidate,
                          checkpoint_every_for, choice_overrides, choose_shape, default_choice,
                          dropout_for, warmup_for)
from aiayn.config import load_config
from aiayn.errors import ConfigError

CORPUS_TOKENS = 29_000 * 13  # Multi30k's German side, about
TOKENS_PER_UPDATE = 1_500


def machine(member_rate: float, single_rate: float) -> list[Candidate]:
    """Two one-thread members at ``member_rate`` updates/s each; one two-thread model."""
    return [Candidate(2, 1, MEMBER_PRESET, member_rate, TOKENS_PER_UPDATE),
            Candidate(1, 2, SINGLE_PRESET, single_rate, TOKENS_PER_UPDATE)]


def epochs_per_s(rate: float) -> float:
    return rate * TOKENS_PER_UPDATE / CORPUS_TOKENS


def test_a_fast_machine_gets_the_ensemble_and_a_slow_one_one_model() -> None:
    hour = 3600.0
    need = TARGET_EPOCHS / epochs_per_s(1.0) / hour  # member updates/s that just reach it
    fast = choose_shape(machine(1.1 * need, 1.7 * need), hour, CORPUS_TOKENS, 1600)
    assert (fast.members, fast.threads, fast.preset) == (2, 1, MEMBER_PRESET)
    assert fast.projected_epochs >= TARGET_EPOCHS and "members reaches" in fast.reason
    slow = choose_shape(machine(0.9 * need, 1.5 * need), hour, CORPUS_TOKENS, 1600)
    assert (slow.members, slow.threads, slow.preset) == (1, 2, SINGLE_PRESET)
    assert "would reach only" in slow.reason
    # the same machine given a longer budget can afford the ensemble again
    longer = choose_shape(machine(0.9 * need, 1.5 * need), 2 * hour, CORPUS_TOKENS, 1600)
    assert longer.members == 2
    assert {c["members"] for c in slow.candidates} == {1, 2}
    assert "one model × 2 thread(s)" in slow.line() and "warmup" in slow.line()


def test_the_warmup_is_a_share_of_the_projected_updates_capped_by_the_preset() -> None:
    assert warmup_for(10_000, 1600) == 1600
    assert warmup_for(2_400, 1600) == round(WARMUP_SHARE * 2_400) < 1600
    assert warmup_for(1, 1600) == 1
    # a Zen 4 hour (about 5,800 updates a member) keeps the preset's 1,600
    assert warmup_for(5_758, 1600) == 1600
    budget = 1200.0
    small = choose_shape(machine(0.5, 0.9), budget, CORPUS_TOKENS, 1600)
    big = choose_shape(machine(0.5, 0.9), 2 * budget, CORPUS_TOKENS, 1600)
    assert small.warmup_steps < big.warmup_steps <= 1600
    assert small.warmup_steps == warmup_for(small.projected_updates, 1600)


def test_dropout_follows_the_projected_epochs() -> None:
    caps = {"model.P_drop": LOW_P_DROP, "model.attention_dropout": LOW_ATTENTION_DROPOUT}
    assert dropout_for(LOW_DROPOUT_EPOCHS) == {} and dropout_for(LOW_DROPOUT_EPOCHS - 0.1) == caps
    hour = 3600.0
    need = TARGET_EPOCHS / epochs_per_s(1.0) / hour  # member updates/s that just reach it
    members = choose_shape(machine(1.1 * need, 1.7 * need), hour, CORPUS_TOKENS, 1600)
    assert members.members == 2 and members.dropout == {}  # members reach TARGET_EPOCHS
    # one model: the preset's dropout over a long budget, the caps over a short one
    single_rate = LOW_DROPOUT_EPOCHS / epochs_per_s(1.0) / hour  # reaches it in the hour
    long = choose_shape(machine(0.5 * need, 1.2 * single_rate), hour, CORPUS_TOKENS, 1600)
    short = choose_shape(machine(0.5 * need, 1.2 * single_rate), hour / 2, CORPUS_TOKENS, 1600)
    assert long.members == short.members == 1
    assert long.dropout == {} and "at most" not in long.line()
    assert short.dropout == caps and "P_drop at most 0.1" in short.line()
    assert default_choice(2, "one core", 1600).dropout == {}
    # the run gets min(preset, cap), and a field the user set stays the user's
    model = load_config(SINGLE_PRESET).model  # P_drop 0.2, attention dropout 0.1
    low_p, low_att = min(model.P_drop, LOW_P_DROP), min(model.attention_dropout,
                                                        LOW_ATTENTION_DROPOUT)
    assert (low_p, low_att) == (LOW_P_DROP, LOW_ATTENTION_DROPOUT)  # the preset's are higher
    assert choice_overrides(short, [], model) == [
        f"train.warmup_steps={short.warmup_steps}", f"model.P_drop={low_p}",
        f"model.attention_dropout={low_att}"]
    assert choice_overrides(short, ["model.P_drop=0.3", "train.warmup_steps=5"], model) == [
        f"model.attention_dropout={low_att}"]
    none = load_config("tiny").model  # P_drop 0: a cap never raises it
    assert f"model.P_drop={none.P_drop}" in choice_overrides(short, [], none)
    assert choice_overrides(long, [], model) == [f"train.warmup_steps={long.warmup_steps}"]


def test_a_budget_too_short_is_refused_with_the_minimum() -> None:
    rate = 2.0
    with pytest.raises(ConfigError, match=r"too few to train a model: give at least "
                                          rf"{MIN_UPDATES / rate / 60:.1f} minutes"):
        choose_shape(machine(1.0, rate), 60.0, CORPUS_TOKENS, 1600)
    assert choose_shape(machine(1.0, rate), MIN_UPDATES / rate, CORPUS_TOKENS, 1600).members


def test_without_a_single_model_candidate_or_with_a_bad_budget_it_says_so() -> None:
    with pytest.raises(ConfigError, match="no single-model candidate"):
        choose_shape(machine(1.0, 1.0)[:1], 3600, CORPUS_TOKENS, 1600)
    with pytest.raises(ConfigError, match="must be positive"):
        choose_shape(machine(1.0, 1.0), 0, CORPUS_TOKENS, 1600)


def test_the_fallback_is_stated_and_fits_the_cores() -> None:
    two = default_choice(2, "one core", 1600)
    assert (two.members, two.threads, two.preset) == (2, 1, MEMBER_PRESET)
    one = default_choice(1, "one core", 1600)
    assert (one.members, one.preset) == (1, SINGLE_PRESET)
    assert "the probe could not run (one core)" in one.reason


def test_the_checkpoints_follow_the_budget() -> None:
    # the hour and longer keep the preset's 120 s; a short budget writes as many checkpoints
    assert checkpoint_every_for(3600, 120) == 120 == checkpoint_every_for(7200, 120)
    assert checkpoint_every_for(600, 120) == 600 / CHECKPOINTS_PER_BUDGET < 120
    assert checkpoint_every_for(10, 120) == MIN_CHECKPOINT_EVERY_S  # never a flood of them
    assert checkpoint_every_for(600, 0) == 0 and checkpoint_every_for(0, 120) == 120
    model = load_config(SINGLE_PRESET).model
    short = replace(choose_shape(machine(0.5, 0.9), 600, CORPUS_TOKENS, 1600),
                    checkpoint_every_s=checkpoint_every_for(600, 120))
    assert f"train.checkpoint_every_s={short.checkpoint_every_s}" in choice_overrides(
        short, [], model)
    assert "a checkpoint every 20 s" in short.line()
    assert not any(o.startswith("train.checkpoint_every_s=") for o in choice_overrides(
        short, ["train.checkpoint_every_s=7"], model))  # the user's interval stays
