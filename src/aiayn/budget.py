"""The main job's shape for the machine at hand: how many models train at once, on how many
threads each, which preset, and how long the warmup lasts, chosen from measured throughput
before the budget's clock starts.

The rule (``docs/recipe.md``, "The shape follows the machine"):

1. Each candidate shape (``members`` models of ``preset`` at once, ``threads`` threads each)
   has a measured rate of updates per second per member, and a batch of about
   ``tokens_per_update`` target tokens. Over the budget a member is projected to make
   ``rate × budget`` updates, ``updates × tokens_per_update / corpus_tokens`` epochs.
2. The ensemble with the most members whose members still reach :data:`TARGET_EPOCHS` wins.
   Else one model over all the threads: it sees about 1.7× the tokens of one of two members,
   on the cheaper ``multi30k`` preset (d_ff 512, about 23% fewer multiply-adds a token than
   the members' 1,024). The hours in ``docs/results-log.md`` place the threshold: a single
   model levels off near 41.5 val from about 25 epochs, and below that each epoch is worth
   about +0.5; two members of 23-25 epochs each (bf16 class) gave val 42.1-42.3 against 41.3-42.3
   for one model of 45 epochs, while two members of 16 epochs (AVX2 class) gave 39.3, where
   one model of about 27 epochs sits near the plateau. 20 lies between; the budget-curve runs
   of ``docs/recipe.md`` are to place it more finely.
3. The warmup is :data:`WARMUP_SHARE` of the projected updates, at most the preset's own
   (1,600): a bf16-class hour (about 5,800 updates a member on a Zen 4) keeps 1,600, and a
   slow CPU no longer spends most of its hour warming up.
4. Dropout follows the projected epochs: a model projected to train fewer than
   :data:`LOW_DROPOUT_EPOCHS` epochs trains with ``P_drop`` at most :data:`LOW_P_DROP` and
   attention dropout at most :data:`LOW_ATTENTION_DROPOUT` (:func:`dropout_for`); the preset's
   0.2 / 0.1 were chosen on val for hours of 25-48 epochs, and regularise more than a short
   run can use; the val runs that placed the threshold (a large gain at 8 epochs, none left
   at 16) are in ``docs/recipe.md``, "Dropout follows the budget". Ensemble members, which
   reach :data:`TARGET_EPOCHS` by rule 2, keep the preset's dropout.
5. The checkpoints follow the budget: one every ``budget / CHECKPOINTS_PER_BUDGET`` seconds, at
   most the preset's ``train.checkpoint_every_s`` (120 s) and at least
   :data:`MIN_CHECKPOINT_EVERY_S` (:func:`checkpoint_every_for`). The hour keeps its 120 s, so
   its last 5 checkpoints, which the job averages, are its last sixth; a short budget's last 5
   are its last sixth too, not most of the run (a 10-minute run with 120 s averaged its steps
   541-1,319 of 1,319, val 29.61 with beam 4, under its last checkpoint's 32.34 with greedy
   search; docs/recipe.md, "The checkpoints follow the budget").

A shape given by the user (``--ensemble``, ``--preset``, ``--set train.warmup_steps``,
``--set model.P_drop=...``) is kept: this rule only fills what was left to it
(:func:`choice_overrides`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from aiayn.errors import ConfigError

#: Epochs a member must reach for an ensemble to be chosen over one model.
TARGET_EPOCHS = 20.0
#: The warmup, as a share of the projected updates (capped by the preset's warmup_steps).
WARMUP_SHARE = 0.28
#: Below this many projected epochs a model trains with less dropout (:func:`dropout_for`).
LOW_DROPOUT_EPOCHS = 12.0
#: A short run's caps on ``model.P_drop`` and ``model.attention_dropout``.
LOW_P_DROP = 0.1
LOW_ATTENTION_DROPOUT = 0.0
#: Checkpoints written in a budget (rule 5): the hour's 30, one every 120 s.
CHECKPOINTS_PER_BUDGET = 30
#: The shortest interval between checkpoints (rule 5), seconds.
MIN_CHECKPOINT_EVERY_S = 5.0
#: Fewest projected updates that can train anything: the budget's floor.
MIN_UPDATES = 200
#: The ensemble members' preset and the single model's.
MEMBER_PRESET = "multi30k-ensemble"
SINGLE_PRESET = "multi30k"


@dataclass(frozen=True)
class Candidate:
    """One shape and what the probe measured of it.

    Attributes:
        members: models trained at once (separate processes).
        threads: torch threads of each member.
        preset: the members' preset.
        updates_per_s: measured updates a second of one member while all members ran.
        tokens_per_update: target tokens in one update (the preset's batch, as measured).
    """

    members: int
    threads: int
    preset: str
    updates_per_s: float
    tokens_per_update: float

    def projected_updates(self, budget_s: float) -> float:
        return self.updates_per_s * budget_s

    def projected_epochs(self, budget_s: float, corpus_tokens: int) -> float:
        return self.projected_updates(budget_s) * self.tokens_per_update / corpus_tokens


@dataclass(frozen=True)
class Choice:
    """The shape chosen, and the figures behind it (recorded in ``results.json``)."""

    members: int
    threads: int
    preset: str
    warmup_steps: int
    projected_updates: int
    projected_epochs: float
    reason: str
    candidates: list[dict[str, Any]] = field(default_factory=list)
    dropout: dict[str, float] = field(default_factory=dict)
    #: seconds between checkpoints (rule 5); 0: the preset's own
    checkpoint_every_s: float = 0.0

    def line(self) -> str:
        """One line for the job's start: the shape and why."""
        shape = (f"{self.members} members × {self.threads} thread(s)" if self.members > 1
                 else f"one model × {self.threads} thread(s)")
        dropout = "".join(f", {key.split('.')[-1]} at most {cap:g}"
                          for key, cap in self.dropout.items())
        every = (f", a checkpoint every {self.checkpoint_every_s:g} s"
                 if self.checkpoint_every_s else "")
        return (f"shape: {shape} of {self.preset}, projected {self.projected_updates:,} "
                f"updates ({self.projected_epochs:.1f} epochs) each, warmup "
                f"{self.warmup_steps:,}{dropout}{every}: {self.reason}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def warmup_for(projected_updates: float, preset_warmup: int) -> int:
    """The warmup for a run projected to make ``projected_updates`` updates:
    :data:`WARMUP_SHARE` of them, at most ``preset_warmup``, at least 1."""
    return max(1, min(preset_warmup, round(WARMUP_SHARE * projected_updates)))


def checkpoint_every_for(budget_s: float, preset_every_s: float) -> float:
    """Seconds between checkpoints for a budget of ``budget_s`` seconds (rule 5):
    ``budget_s / CHECKPOINTS_PER_BUDGET``, at most ``preset_every_s`` and at least
    :data:`MIN_CHECKPOINT_EVERY_S`; 0 (no budget, or the preset writes none by time) keeps
    ``preset_every_s``."""
    if budget_s <= 0 or preset_every_s <= 0:
        return preset_every_s
    return min(preset_every_s, max(MIN_CHECKPOINT_EVERY_S, budget_s / CHECKPOINTS_PER_BUDGET))


def dropout_for(projected_epochs: float) -> dict[str, float]:
    """Caps on the config's dropout fields for a model projected to train ``projected_epochs``
    epochs: ``{"model.P_drop": LOW_P_DROP, "model.attention_dropout": LOW_ATTENTION_DROPOUT}``
    below :data:`LOW_DROPOUT_EPOCHS`, else none (the preset's own). A cap never raises a
    preset's value (``aiayn pipeline`` applies ``min(preset, cap)``)."""
    if projected_epochs >= LOW_DROPOUT_EPOCHS:
        return {}
    return {"model.P_drop": LOW_P_DROP, "model.attention_dropout": LOW_ATTENTION_DROPOUT}


def choice_overrides(choice: Choice, overrides: list[str], model: Any) -> list[str]:
    """The ``--set`` values (``SECTION.FIELD=VALUE``) that ``choice`` adds to the user's
    ``overrides``: its warmup, its checkpoint interval (when it has one), and its dropout caps
    as ``min(the preset's value, cap)`` (``model``: the chosen preset's model config, the
    user's overrides applied), each only where the user did not set that field."""
    wanted: dict[str, Any] = {"train.warmup_steps": choice.warmup_steps}
    if choice.checkpoint_every_s:
        wanted["train.checkpoint_every_s"] = choice.checkpoint_every_s
    for key, cap in choice.dropout.items():
        wanted[key] = min(getattr(model, key.split(".", 1)[1]), cap)
    return [f"{key}={value}" for key, value in wanted.items()
            if not any(o.startswith(f"{key}=") for o in overrides)]


def choose_shape(candidates: list[Candidate], budget_s: float, corpus_tokens: int,
                 preset_warmup: int) -> Choice:
    """The shape for ``budget_s`` seconds by the rule of this module's docstring.

    Args:
        candidates: measured shapes; at least one with ``members == 1``.
        budget_s: the training budget, seconds of wall clock per member.
        corpus_tokens: target tokens of one epoch of the training corpus.
        preset_warmup: the preset's ``train.warmup_steps``, the warmup's cap.

    Raises:
        ConfigError: no single-model candidate, or a budget too short for
            :data:`MIN_UPDATES` updates of the fastest single model (the message gives the
            minimum in minutes).
    """
    singles = [c for c in candidates if c.members == 1]
    if not singles:
        raise ConfigError("choose_shape: no single-model candidate was measured")
    if budget_s <= 0 or corpus_tokens <= 0:
        raise ConfigError(f"choose_shape: budget_s and corpus_tokens must be positive, got "
                          f"{budget_s} and {corpus_tokens}")
    single = max(singles, key=lambda c: c.updates_per_s)
    if single.projected_updates(budget_s) < MIN_UPDATES:
        minimum = MIN_UPDATES / single.updates_per_s / 60
        raise ConfigError(f"a budget of {budget_s / 60:.2f} minutes makes about "
                          f"{single.projected_updates(budget_s):.0f} updates on this machine, "
                          f"too few to train a model: give at least {minimum:.1f} minutes "
                          f"(--time-budget-min)")
    table = [{**asdict(c), "projected_updates": round(c.projected_updates(budget_s)),
              "projected_epochs": round(c.projected_epochs(budget_s, corpus_tokens), 1)}
             for c in candidates]
    reaching = [c for c in candidates if c.members > 1
                and c.projected_epochs(budget_s, corpus_tokens) >= TARGET_EPOCHS]
    if reaching:
        best = max(reaching, key=lambda c: (c.members, c.updates_per_s))
        reason = (f"each of {best.members} members reaches {TARGET_EPOCHS:g} epochs "
                  "(an ensemble adds about +1 BLEU once its members level off)")
    else:
        best = single
        most = max((c for c in candidates if c.members > 1),
                   key=lambda c: c.projected_epochs(budget_s, corpus_tokens), default=None)
        reason = ("no ensemble was measured" if most is None else
                  f"{most.members} members would reach only "
                  f"{most.projected_epochs(budget_s, corpus_tokens):.1f} epochs each, under "
                  f"{TARGET_EPOCHS:g}: one model sees more of the corpus")
    updates = best.projected_updates(budget_s)
    epochs = best.projected_epochs(budget_s, corpus_tokens)
    return Choice(members=best.members, threads=best.threads, preset=best.preset,
                  warmup_steps=warmup_for(updates, preset_warmup),
                  projected_updates=round(updates), projected_epochs=round(epochs, 1),
                  reason=reason, candidates=table, dropout=dropout_for(epochs))


def default_choice(cores: int, why: str, preset_warmup: int) -> Choice:
    """The stated fallback when the probe cannot run (``why``): two one-thread members of
    :data:`MEMBER_PRESET` on two or more cores (the recipe before this rule), else one model
    of :data:`SINGLE_PRESET`; the preset's warmup."""
    if cores >= 2:
        return Choice(2, max(1, cores // 2), MEMBER_PRESET, preset_warmup, 0, 0.0,
                      f"the probe could not run ({why}); the default shape")
    return Choice(1, 1, SINGLE_PRESET, preset_warmup, 0, 0.0,
                  f"the probe could not run ({why}); the default shape for one core")


__all__ = ["CHECKPOINTS_PER_BUDGET", "Candidate", "Choice", "LOW_ATTENTION_DROPOUT",
           "LOW_DROPOUT_EPOCHS", "LOW_P_DROP", "MEMBER_PRESET", "MIN_CHECKPOINT_EVERY_S",
           "MIN_UPDATES", "SINGLE_PRESET", "TARGET_EPOCHS", "WARMUP_SHARE",
           "checkpoint_every_for", "choice_overrides", "choose_shape", "default_choice",
           "dropout_for", "warmup_for"]
