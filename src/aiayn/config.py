"""Typed, validated configuration: model (§3), data (§5.1), training (§5.2-5.4), decoding (§6.1).

A run is described by one :class:`Config`, made of four frozen dataclasses. Named presets are
TOML files in ``aiayn/configs/`` (``base``, ``big``, every row of Table 3 as ``table3-A1`` …
``table3-E``, and small presets for CPU work); a preset may ``extends = "other.toml"`` one level.
Every value is checked at construction: a bad one raises ``ValueError`` naming the field and value.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import tomllib
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from aiayn.errors import ConfigError

PRESET_DIR = resources.files("aiayn") / "configs"
# train.lr_schedule: name -> what it is (aiayn.training.schedule)
LR_SCHEDULE_TITLES = {"inverse_sqrt": "§5.3, eq. 3",
                      "linear": "linear decay to zero at the budget",
                      "cosine": "cosine decay to zero at the budget"}
LR_SCHEDULES = tuple(LR_SCHEDULE_TITLES)
# the kinds of text a model reads (aiayn.data.text, which names them for the package): stated
# here, below it, because DataConfig checks data.preprocess against them
RAW_TEXT, PROTOCOL_TEXT = "none", "lc-norm-tok"
PREPROCESS_MODES = (RAW_TEXT, PROTOCOL_TEXT)
TRAIN_PRECISIONS = ("auto", "fp32", "bf16", "bf16-weights", "fp16")  # aiayn.precision
DIST_BACKENDS = ("auto", "nccl", "gloo")  # aiayn.training.distributed.init_distributed
DDP_COMPRESSIONS = ("none", "bf16")  # aiayn.training.distributed.data_parallel
RESUME_MODES = ("no", "auto")  # aiayn.training.run.run_training
DECODE_PRECISIONS = ("auto", "fp32", "bf16", "int8")  # aiayn.precision
# fields that runs of earlier versions wrote into config.json, replaced by train.precision
_BEFORE_PRECISION = ("train.bf16", "train.bf16_weights")


def _check_fields(obj: Any) -> None:
    """Reject a field whose value has the wrong type (an int field given 2.5, a bool given
    "no"); an int given for a float field is stored as that float."""
    for name, hint in _field_types(type(obj)).items():
        value = getattr(obj, name)
        checked = _check_type(value, hint, f"{type(obj).__name__}.{name}")
        if checked is not value:
            object.__setattr__(obj, name, checked)  # frozen: the one sanctioned way to coerce


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{type(obj).__name__}.{name} must be positive, got {value!r}")


def _non_negative(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{type(obj).__name__}.{name} must be >= 0, got {value!r}")


def _probability(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
            raise ConfigError(f"{type(obj).__name__}.{name} must be in [0, 1), got {value!r}")


def _choice(obj: Any, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    if value not in choices:
        raise ConfigError(f"{type(obj).__name__}.{name} must be one of {choices}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of §3 and Table 3. Defaults are the base model."""

    N: int = 6  # layers in each of the encoder and decoder stacks
    d_model: int = 512
    d_ff: int = 2048  # inner dimension of the position-wise FFN, §3.3
    h: int = 8  # attention heads
    d_k: int = 64  # query/key size per head; Table 3 rows (A), (B) set it apart from d_model/h
    d_v: int = 64  # value size per head
    P_drop: float = 0.1  # residual and embedding dropout, §5.4
    attention_dropout: float = 0.0  # dropout on attention weights (not in the paper)
    # source word dropout (not in the paper): while training, each source token's embedding
    # is zeroed with this probability (Sennrich et al. 2016, Gal & Ghahramani 2016)
    word_dropout: float = 0.0
    vocab_size: int = 37000  # shared source-target vocabulary, §5.1
    tgt_vocab_size: int | None = None  # None: shared with the source (§3.4 tying needs that)
    share_embeddings: bool = True  # one matrix for source, target embeddings and softmax, §3.4
    positional: str = "sinusoidal"  # or "learned" (Table 3 row E)
    max_len: int = 1024  # longest sequence the positional table holds, in tokens
    norm: str = "post"  # "post": LayerNorm(x + Dropout(Sublayer(x))) as §3.1; "pre" optional
    layer_norm_eps: float = 1e-6
    pad_id: int = 0
    attention_window: int | None = None  # r of §4's restricted self-attention; None: all
    # "target": the output layer scores only the tokens seen on the target side of the
    # training data; the others get a fixed -inf logit bias (not in the paper: with a joint
    # vocabulary, source-only subwords then cost no output-layer work; README, the hour)
    output_vocab: str = "all"
    # Options for models imported from Hugging Face Marian / OPUS-MT (`aiayn convert`); the
    # defaults are the paper's choices.
    ffn_activation: str = "relu"  # §3.3 max(0, ·); OPUS-MT uses "swish" (x * sigmoid(x))
    positional_layout: str = "interleaved"  # §3.5 sin at 2i, cos at 2i+1; Marian: "halves"
    final_logits_bias: bool = False  # a (V_tgt,) bias added to the output logits (Marian)
    decoder_start_id: int = 1  # first decoder input: BOS (id 1); Marian starts with pad

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.attention_window is not None:
            _positive(self, "attention_window")
        _positive(self, "N", "d_model", "d_ff", "h", "d_k", "d_v", "vocab_size", "max_len")
        _positive(self, "layer_norm_eps")
        _probability(self, "P_drop", "attention_dropout", "word_dropout")
        _choice(self, "positional", ("sinusoidal", "learned"))
        _choice(self, "norm", ("post", "pre"))
        _choice(self, "ffn_activation", ("relu", "swish"))
        _choice(self, "positional_layout", ("interleaved", "halves"))
        _choice(self, "output_vocab", ("all", "target"))
        if self.tgt_vocab_size is not None:
            _positive(self, "tgt_vocab_size")
        if self.share_embeddings and self.tgt_vocab_size not in (None, self.vocab_size):
            raise ConfigError(
                "ModelConfig.share_embeddings=True needs one shared vocabulary, but "
                f"vocab_size={self.vocab_size} and tgt_vocab_size={self.tgt_vocab_size}"
            )
        if not 0 <= self.pad_id < self.vocab_size:
            raise ConfigError(f"ModelConfig.pad_id={self.pad_id} is outside the vocabulary")
        if not 0 <= self.decoder_start_id < self.target_vocab_size:
            raise ConfigError(f"ModelConfig.decoder_start_id={self.decoder_start_id} is outside "
                             f"the target vocabulary of {self.target_vocab_size}")

    @property
    def has_dropout(self) -> bool:
        """Whether any dropout rate (``P_drop``, ``attention_dropout``, ``word_dropout``) is
        above 0, i.e. whether training draws any dropout mask at all."""
        return self.P_drop > 0 or self.attention_dropout > 0 or self.word_dropout > 0

    @property
    def target_vocab_size(self) -> int:
        return self.vocab_size if self.tgt_vocab_size is None else self.tgt_vocab_size


@dataclass(frozen=True)
class DataConfig:
    """Corpus, vocabulary and batching, §5.1."""

    dataset: str = "multi30k"  # a named dataset, or "files" with the paths below
    src_lang: str = "en"
    tgt_lang: str = "de"
    train_src: str | None = None  # with dataset = "files": aligned text files (plain or .gz)
    train_tgt: str | None = None
    valid_src: str | None = None
    valid_tgt: str | None = None
    # a folder written by `aiayn prepare`: the training pairs are read from it (memory-mapped),
    # not from the dataset's training files (aiayn.data.prepared)
    prepared: str | None = None
    vocab_size: int = 8000  # subword vocabulary size learned by `aiayn vocab`
    vocab_kind: str = "bpe"  # "bpe" (EN-DE) or "wordpiece" (EN-FR), §5.1
    # "none": text as distributed (cased); "lc-norm-tok": lowercased, normalized and
    # Moses-tokenized as the Multi30k literature scores it (aiayn.data.text)
    preprocess: str = "none"
    # tokens per batch on each side, per process and per accumulation step, §5.1 used ~25000
    # in all; 0: derived from global_max_tokens (see batch_tokens_per_process)
    max_tokens: int = 4096
    # > 0: the tokens of one update on each side, over all processes and accumulation steps
    # (the paper's 25000, §5.1), stated once for any world size: each process's batches get
    # global_max_tokens // (processes x train.accum_steps); then max_tokens must be 0 or that
    global_max_tokens: int = 0
    max_len: int = 256  # pairs longer than this (subword tokens, either side) are dropped
    train_limit: int = 0  # use only the first N training pairs (smoke runs); 0: all
    # the vocabulary is learned from at most this many sentences: both sides of pairs drawn
    # once with a fixed seed (aiayn.data.vocab.sample_pair_indices); 0: all. Marian's default
    vocab_sample_lines: int = 2_000_000
    # > 0: BPE-dropout (Provilkov et al. 2020; not in the paper): every epoch segments the
    # training text anew, skipping each BPE merge with this probability (aiayn.data.bpe_dropout)
    bpe_dropout: float = 0.0

    def __post_init__(self) -> None:
        _check_fields(self)
        _positive(self, "vocab_size", "max_len")
        _non_negative(self, "train_limit", "max_tokens", "global_max_tokens",
                      "vocab_sample_lines")
        if self.max_tokens == 0 and self.global_max_tokens == 0:
            raise ConfigError("DataConfig.max_tokens = 0 (derived from the global batch) needs "
                              "data.global_max_tokens > 0")
        if self.vocab_sample_lines == 1:
            raise ConfigError("DataConfig.vocab_sample_lines = 1: a sample takes both sides of a "
                              "pair, so give at least 2 (or 0 for all)")
        _choice(self, "vocab_kind", ("bpe", "wordpiece"))
        _choice(self, "preprocess", PREPROCESS_MODES)
        _probability(self, "bpe_dropout")
        if self.bpe_dropout > 0 and self.vocab_kind != "bpe":
            raise ConfigError(f"DataConfig.bpe_dropout needs vocab_kind 'bpe', not "
                             f"{self.vocab_kind!r}")


def batch_tokens_per_process(data: DataConfig, world_size: int, accum_steps: int) -> int:
    """Each process's ``max_tokens`` (a side, a micro-batch), the rule in one place.

    Without ``data.global_max_tokens`` it is ``data.max_tokens``. With it, one update is
    ``global_max_tokens`` tokens a side over ``world_size`` processes and ``accum_steps``
    accumulation steps, so each batch gets ``global_max_tokens // (world_size x accum_steps)``
    (rounded down: the update is never larger than stated). ``data.max_tokens`` must then be 0
    (derived) or that same number.

    Raises:
        ConfigError: ``max_tokens`` and ``global_max_tokens`` disagree (both values, the
            processes and accumulation steps named), or the share is under one token.
    """
    if data.global_max_tokens == 0:
        return data.max_tokens
    share = world_size * accum_steps
    per = data.global_max_tokens // share
    if per < 1:
        raise ConfigError(f"data.global_max_tokens={data.global_max_tokens} over {world_size} "
                          f"process(es) x train.accum_steps={accum_steps} leaves no token a batch")
    if data.max_tokens not in (0, per):
        raise ConfigError(
            f"data.max_tokens={data.max_tokens} and data.global_max_tokens="
            f"{data.global_max_tokens} disagree: over {world_size} process(es) x "
            f"train.accum_steps={accum_steps} the global batch gives {per} tokens a batch; "
            "state one of them (--set data.max_tokens=0 lets the global decide)")
    return per


@dataclass(frozen=True)
class TrainConfig:
    """Optimiser, schedule and regularisation, §5.3-5.4, and run bookkeeping."""

    seed: int = 1
    epsilon_ls: float = 0.1  # label smoothing, §5.4
    warmup_steps: int = 4000  # §5.3
    lr_scale: float = 1.0  # multiplies the §5.3 learning rate (small batches want more)
    peak_lr: float = 0.0  # > 0: the peak learning rate itself (then lr_scale is unused)
    # "inverse_sqrt" (§5.3, eq. 3), or "linear" / "cosine": warmup, then decay to zero when
    # max_steps or time_budget_s is spent (aiayn.training.schedule)
    lr_schedule: str = "inverse_sqrt"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-9
    weight_decay: float = 0.0  # an L2 term in Adam's gradient, or see decoupled_weight_decay
    # with weight_decay > 0: AdamW's decay (Loshchilov & Hutter 2019; not in the paper) on the
    # matrices and embeddings only, lr x weight_decay a step apart from the gradient
    decoupled_weight_decay: bool = False
    accum_steps: int = 1  # batches whose gradients are summed into one update
    clip_norm: float = 0.0  # 0: no gradient clipping
    max_steps: int = 100_000  # updates; base trained 100K, big 300K (§5.2)
    time_budget_s: float = 0.0  # 0: no limit; else stop after this many seconds of training
    # "fp32"; "bf16" (torch.autocast); "bf16-weights" (forward and backward on a bf16 copy of
    # the weights, Adam on the float32 masters that checkpoints hold); "fp16" (torch.autocast
    # in float16 with a dynamic loss scale, torch.amp.GradScaler); "auto": on a CPU
    # bf16-weights where a short probe finds bf16 faster, else fp32; on a GPU bf16 from
    # compute capability 8.0, fp16 below it (aiayn.precision)
    precision: str = "auto"
    # float32 matrix products on GPUs of compute capability 8.0 or more (Ampere and later) in
    # TF32 (torch.backends.cuda.matmul); false keeps them in full float32
    tf32: bool = True
    # both may be on; each writes checkpoints/step-N when due. The paper wrote one every
    # 10 minutes (§6.1); base and big state it in updates (configs/base.toml)
    checkpoint_every_steps: int = 0  # 0: off
    checkpoint_every_s: float = 600.0  # 0: off
    keep_last: int = 5  # checkpoints kept; averaging uses the last 5 (base) or 20 (big)
    # > 0: also keep an exponential moving average of the weights, updated after every update
    # with this decay (not in the paper, whose §6.1 averages checkpoints), saved as RUN/ema
    ema_decay: float = 0.0
    # > 0: late dropout (Liu et al. 2023, not in the paper): the model's dropout stays off until
    # this fraction of the budget (as the lr schedule measures it: max_steps or time_budget_s)
    late_dropout_start: float = 0.0
    # > 0: R-Drop (Liang et al. 2021, not in the paper): each batch goes through the model twice
    # with different dropout masks, and the loss adds this weight times the two output
    # distributions' symmetric KL divergence (aiayn.training.loss.rdrop_loss)
    rdrop_alpha: float = 0.0
    # with rdrop_alpha > 0: R-Drop waits until this fraction of the budget (as the lr schedule
    # measures it) is spent; before it, each batch runs once, as without R-Drop
    rdrop_start: float = 0.0
    # > 0: guided alignment (Garg et al. 2019, EMNLP; not in the paper): the loss adds this
    # weight times the cross-entropy between one cross-attention head (decoder layer
    # guided_alignment_layer, negative counts from the top: -2 is the penultimate layer as in
    # Garg et al.; head guided_alignment_head) and reference links from IBM Model 1 learned on
    # the training pairs (aiayn.decoding.alignment); Garg et al. use 0.05
    guided_alignment_weight: float = 0.0
    guided_alignment_layer: int = -2
    guided_alignment_head: int = 0
    eval_every_steps: int = 1000
    eval_bleu_sentences: int = 500  # validation sentences decoded greedily for BLEU; 0: none
    early_stopping_patience: int = 0  # evaluations without a better BLEU before stopping; 0: off
    max_nonfinite: int = 10  # non-finite losses in a row before the run stops
    log_every_steps: int = 50
    # under torchrun: the process group's backend ("auto": nccl on CUDA, gloo on a CPU; "gloo"
    # also lets several processes share one GPU) and how long a collective may wait
    dist_backend: str = "auto"
    dist_timeout_s: float = 1800.0
    # DDP (aiayn.training.distributed.data_parallel): gradients all-reduced in buckets of this
    # many MiB (torch's default), sent as they are ("none") or compressed to bf16 ("bf16":
    # half the bytes, for slow links between nodes)
    ddp_bucket_mb: float = 25.0
    ddp_compression: str = "none"
    # "auto": resume when the run folder holds a checkpoint, else start afresh (one command
    # for torchrun --max-restarts and a requeued job; the CLI's --resume auto); "no": a run
    # folder with checkpoints is refused unless --resume is given
    resume: str = "no"

    def __post_init__(self) -> None:
        _check_fields(self)
        _positive(self, "warmup_steps", "lr_scale", "adam_eps", "accum_steps", "max_steps")
        _positive(self, "dist_timeout_s")
        _choice(self, "dist_backend", DIST_BACKENDS)
        _positive(self, "ddp_bucket_mb")
        _choice(self, "ddp_compression", DDP_COMPRESSIONS)
        _choice(self, "resume", RESUME_MODES)
        _positive(self, "keep_last", "eval_every_steps", "max_nonfinite", "log_every_steps")
        _non_negative(self, "clip_norm", "time_budget_s", "checkpoint_every_steps")
        _non_negative(self, "checkpoint_every_s", "eval_bleu_sentences", "weight_decay")
        _non_negative(self, "early_stopping_patience", "peak_lr", "rdrop_alpha")
        _non_negative(self, "guided_alignment_weight", "guided_alignment_head")
        _choice(self, "lr_schedule", LR_SCHEDULES)
        _choice(self, "precision", TRAIN_PRECISIONS)
        if self.rdrop_start > 0 and self.rdrop_alpha == 0:
            raise ConfigError("TrainConfig.rdrop_start > 0 needs rdrop_alpha > 0 (R-Drop's "
                             f"weight), got rdrop_start={self.rdrop_start}, rdrop_alpha=0")
        if self.decoupled_weight_decay and self.weight_decay == 0:
            raise ConfigError("TrainConfig.decoupled_weight_decay=True needs weight_decay > 0")
        _probability(self, "epsilon_ls", "adam_beta1", "adam_beta2", "ema_decay",
                     "late_dropout_start", "rdrop_start")


@dataclass(frozen=True)
class DecodeConfig:
    """Search as §6.1 ran it: beam 4, length penalty alpha 0.6, max length input + 50."""

    beam_size: int = 4
    alpha: float = 0.6  # length penalty ((5 + |Y|) / 6) ** alpha, Wu et al. 2016
    max_len_a: float = 1.0  # maximum output length = max_len_a * input length + max_len_b
    max_len_b: int = 50
    batch_size: int = 64  # sentences decoded together
    beam_rules: str = "t2t"  # "hf" in models converted from Hugging Face (see beam_search)

    def __post_init__(self) -> None:
        _check_fields(self)
        _positive(self, "beam_size", "batch_size")
        _choice(self, "beam_rules", ("t2t", "hf"))
        _non_negative(self, "alpha", "max_len_a", "max_len_b")


@dataclass(frozen=True)
class Config:
    """Everything that shapes a run; saved as ``config.json`` in every run and checkpoint."""

    name: str = "base"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def __post_init__(self) -> None:
        _check_fields(self)
        tc, mc = self.train, self.model
        if tc.guided_alignment_weight > 0 and not (
                -mc.N <= tc.guided_alignment_layer < mc.N and tc.guided_alignment_head < mc.h):
            raise ConfigError(f"train.guided_alignment_layer={tc.guided_alignment_layer} and "
                              f"guided_alignment_head={tc.guided_alignment_head} must name a "
                              f"decoder layer in [-{mc.N}, {mc.N}) and a head in [0, {mc.h})")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> Config:
        """Build a config, rejecting unknown sections or fields with the offending name."""
        return _build(cls, data, source)

    def replace(self, **sections: Any) -> Config:
        return dataclasses.replace(self, **sections)

    def with_overrides(self, overrides: list[str]) -> Config:
        """Apply ``section.field=value`` strings (the CLI's ``--set``), type-checked per field."""
        data = self.to_dict()
        for item in overrides:
            key, sep, raw = item.partition("=")
            section, dot, name = key.strip().partition(".")
            if not sep or not dot:
                raise ConfigError(f"override {item!r} is not of the form section.field=value")
            if section not in data or not isinstance(data[section], dict):
                raise ConfigError(f"override {item!r}: unknown section {section!r}")
            if f"{section}.{name}" in _BEFORE_PRECISION:
                raise ConfigError(f"override {item!r}: {section}.{name} is now train.precision "
                                 f"(one of {', '.join(TRAIN_PRECISIONS)})")
            if name not in data[section]:
                raise ConfigError(f"override {item!r}: unknown field {section}.{name}")
            hint = _field_types(_SECTIONS[section])[name]
            data[section][name] = _parse_value(raw.strip(), hint, f"{section}.{name}")
        return Config.from_dict(data, source="--set")


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "decode": DecodeConfig,
}


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _parse_value(raw: str, hint: Any, where: str) -> Any:
    args = typing.get_args(hint)
    if raw.lower() in ("none", "null") and type(None) in args:
        return None
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    try:
        if base is bool:
            if raw.lower() in ("true", "1", "yes"):
                return True
            if raw.lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if base is int:
            return int(raw)
        if base is float:
            return float(raw)
        return raw
    except ValueError:
        raise ConfigError(f"{where}: cannot read {raw!r} as {getattr(base, '__name__', base)}")


def _check_type(value: Any, hint: Any, where: str) -> Any:
    args = typing.get_args(hint)
    allowed = tuple(a for a in args) if args else (hint,)
    if value is None and type(None) in allowed:
        return None
    base = next((a for a in allowed if a is not type(None)), hint)
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base is int and isinstance(value, bool) or not isinstance(value, base):
        raise ConfigError(f"{where} must be {getattr(base, '__name__', base)}, got {value!r}")
    if base is float and not math.isfinite(value):
        raise ConfigError(f"{where} must be a finite number, got {value!r}")
    return value


def _build(cls: type, data: dict[str, Any], source: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a table, got {data!r}")
    if cls is Config:
        unknown = set(data) - {"name", *_SECTIONS}
        if unknown:
            raise ConfigError(f"{source}: unknown section(s) {sorted(unknown)}; "
                             f"known: {sorted(_SECTIONS)}")
        kwargs: dict[str, Any] = {}
        if "name" in data:
            kwargs["name"] = str(data["name"])
        for section, section_cls in _SECTIONS.items():
            kwargs[section] = _build(section_cls, data.get(section, {}), f"{source} [{section}]")
        return Config(**kwargs)
    types = _field_types(cls)
    if cls is TrainConfig and ("bf16" in data or "bf16_weights" in data):
        data = _legacy_precision(data, source)
    unknown = set(data) - set(types)
    if unknown:
        raise ConfigError(f"{source}: unknown field(s) {sorted(unknown)} for {cls.__name__}")
    kwargs = {k: _check_type(v, types[k], f"{source} {k}") for k, v in data.items()}
    return cls(**kwargs)


def _legacy_precision(data: dict[str, Any], source: str) -> dict[str, Any]:
    """A [train] table of a run written before ``precision`` existed: its ``bf16`` and
    ``bf16_weights`` booleans become the precision they meant."""
    data = dict(data)
    bf16, weights = data.pop("bf16", False), data.pop("bf16_weights", False)
    if "precision" in data:
        raise ConfigError(f"{source}: give train.precision alone, not with the older bf16 / "
                         "bf16_weights")
    if not isinstance(bf16, bool) or not isinstance(weights, bool):
        raise ConfigError(f"{source}: bf16 and bf16_weights must be true or false")
    data["precision"] = ("bf16-weights" if weights else "bf16") if bf16 else "fp32"
    return data


def preset_names() -> list[str]:
    """Names of the shipped presets, e.g. ``base``, ``big``, ``table3-A1``."""
    return sorted(p.name[:-5] for p in PRESET_DIR.iterdir() if p.name.endswith(".toml"))


def read_json_object(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``path``.

    Raises:
        ValueError: the file is not UTF-8 JSON, or holds something other than an object (the
            message names the file, and the line and column of a syntax error).
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _read_toml(path: Path | Any, depth: int = 0) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if depth >= 1:
        raise ConfigError(f"{path}: 'extends' may go one level deep only")
    base = _read_toml(path.parent / parent, depth + 1)
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


def load_config(name_or_path: str, overrides: list[str] | None = None) -> Config:
    """Load a preset by name (``base``, ``table3-C3``…) or a TOML/JSON config file.

    Raises:
        ValueError: unknown preset (the message lists the known ones), unknown field, bad value.
        FileNotFoundError: a path that does not exist.
    """
    path = Path(name_or_path)
    if path.suffix in (".toml", ".json"):
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        if path.suffix == ".json":
            data = read_json_object(path)
        else:
            data = _read_toml(path)
        data.setdefault("name", path.stem)
        source = str(path)
    else:
        preset = PRESET_DIR / f"{name_or_path}.toml"
        if not preset.is_file():
            raise ConfigError(f"unknown preset {name_or_path!r}; known presets: "
                             f"{', '.join(preset_names())}")
        data = _read_toml(preset)
        data["name"] = name_or_path
        source = f"preset {name_or_path}"
    config = Config.from_dict(data, source=source)
    return config.with_overrides(overrides) if overrides else config
