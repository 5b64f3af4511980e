"""Set up and run one training run: config, vocabulary, data, Trainer (used by ``aiayn train``
and ``aiayn pipeline``)."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from aiayn.checkpoint import list_checkpoints, read_meta, recover_run_dir
from aiayn.config import Config, TrainConfig, batch_tokens_per_process, read_json_object
from aiayn.data.batching import encode_corpus
from aiayn.data.corpus import ParallelCorpus
from aiayn.data.splits import load_split, split_paths
from aiayn.data.vocab import Vocabulary, learn_vocabulary
from aiayn.devices import choose_device, keep_freed_memory, widen_onednn_cache
from aiayn.errors import UserError
from aiayn.fileio import check_output_dir, write_json_atomic
from aiayn.rundir import METRICS, RunDir
from aiayn.training.distributed import (
    check_shared_run_dir,
    describe_data_parallel,
    main_choice,
    restart_warning,
)
from aiayn.training.loop import DistInfo, Trainer, init_distributed
from aiayn.training.update import check_same_update


logger = logging.getLogger("aiayn")


def prepare_training_process(device: torch.device) -> None:
    """The process-wide settings of a training process, made where one starts (never on
    import): oneDNN keeps every compiled bf16 product of an epoch
    (:func:`~aiayn.devices.widen_onednn_cache`), and on CPU glibc keeps freed blocks for the
    next step (:func:`~aiayn.devices.keep_freed_memory`)."""
    widen_onednn_cache()
    if device.type == "cpu":
        keep_freed_memory()


def train(config: Config | str, run_dir: str | Path, *, overrides: list[str] | None = None,
          init_from: str | Path | None = None, vocab: str | Path | None = None,
          resume: bool | str = False, device: str | None = None,
          progress: bool = False) -> dict[str, Any]:
    """Train a model from Python, as ``aiayn train`` does (§5's recipe).

    Progress is reported through :mod:`logging` (the ``aiayn`` logger, at INFO); metrics go to
    ``run_dir/metrics.jsonl``; checkpoints to ``run_dir/checkpoints``.

    Args:
        config: a :class:`~aiayn.config.Config`, or a preset name or config file for
            :func:`~aiayn.config.load_config`.
        overrides: ``SECTION.FIELD=VALUE`` strings (``--set``).
        init_from: fine-tune from this model (see :func:`run_training`).
        vocab: an existing vocabulary (``tokenizer.json`` or its folder).
        resume: continue the run in ``run_dir`` from its newest checkpoint; "auto": that
            when it holds one, else start afresh from ``config`` (see :func:`run_training`).
        device: "cpu", "cuda" or "cuda:N" (default: cuda when there is one).
        progress: a tqdm bar on stderr.

    Returns:
        The run's summary (also in ``run_dir/train_summary.json``): steps, epochs,
        ``elapsed_s``, ``stop_reason``, validation figures, precision.

    Raises:
        UserError: see :func:`run_training`.
    """
    from aiayn.config import load_config

    if resume is True:
        config = None
    elif isinstance(config, str):
        config = load_config(config, overrides)
    elif overrides:
        config = config.with_overrides(overrides)
    return run_training(config, run_dir, vocab_path=vocab, resume=resume,
                        overrides=overrides if resume else None, device=device,
                        progress=progress, init_from=init_from)


def _quiet(msg: str) -> None:
    pass


def sized_to(config: Config, vocab: Any) -> Config:
    """``config`` with its model's shared vocabulary the size of ``vocab`` (a new run's model
    is built for the vocabulary it learned or was given, not the config's ``vocab_size``)."""
    model = dataclasses.replace(config.model, vocab_size=len(vocab), tgt_vocab_size=None)
    return config.replace(model=model)


# model fields a resumed run may change: they do not alter the shape or meaning of the weights
RESUMABLE_MODEL_FIELDS = ("P_drop", "attention_dropout", "word_dropout")


def _initial_model(path: str | Path, config: Config, device: torch.device, log: Any):
    """(model, config, vocabulary) to fine-tune from ``path``: its weights, architecture,
    vocabulary, text and decode settings, with ``config``'s dropout, data and training.

    Raises:
        UserError: ``path`` does not load as one model; BPE-dropout with a vocabulary that
            has no BPE merges to drop.
    """
    import dataclasses

    from aiayn.model import Transformer
    from aiayn.pretrained import load_pretrained

    loaded = load_pretrained(path, device, log)
    if len(loaded.models) != 1:
        raise UserError(f"--init-from {path}: an ensemble of {len(loaded.models)}; "
                        "fine-tuning starts from one model (name one member's checkpoint)")
    source, vocab = loaded.config, loaded.vocab
    dropout = {k: getattr(config.model, k) for k in RESUMABLE_MODEL_FIELDS}
    model_cfg = dataclasses.replace(source.model, **dropout)
    model = Transformer(model_cfg).to(device)  # this run's dropout, the model's weights
    model.load_state_dict(loaded.models[0].state_dict())
    data = config.data
    if data.preprocess != source.data.preprocess:
        log(f"aiayn train: --init-from {path} reads data.preprocess = "
            f"{source.data.preprocess!r} text: the training data is read that way too")
        data = dataclasses.replace(data, preprocess=source.data.preprocess)
    if data.max_len > model_cfg.max_len:  # pairs longer than its positional table are dropped
        log(f"aiayn train: --init-from {path} holds {model_cfg.max_len} positions: training "
            f"pairs over {model_cfg.max_len} tokens are dropped (data.max_len)")
        data = dataclasses.replace(data, max_len=model_cfg.max_len)
    if data.bpe_dropout > 0 and not hasattr(vocab, "tokenizer"):
        raise UserError(f"--init-from {path}: its vocabulary is not aiayn's BPE, so "
                        "data.bpe_dropout cannot apply; set data.bpe_dropout=0")
    log(f"aiayn train: starting from the weights of {loaded.sources[0]} (architecture, "
        f"vocabulary of {len(vocab)} and decode settings from it; a fresh optimizer and "
        "schedule)")
    return model, config.replace(model=model_cfg, data=data, decode=source.decode), vocab


def check_resume_overrides(saved: Config, resumed: Config, run_dir: Path) -> None:
    """Refuse ``--set`` changes that cannot apply to the run's checkpoints (any model field
    but dropout: they change the weights' shapes or meaning).

    Raises:
        UserError: naming the field, the checkpoint's value and the new one.
    """
    for name, old in saved.model.__dict__.items():
        new = getattr(resumed.model, name)
        if new != old and name not in RESUMABLE_MODEL_FIELDS:
            raise UserError(f"--resume: model.{name} cannot change in a resumed run (its "
                            f"checkpoints have {old!r}, --set gives {new!r}); train the new "
                            f"shape in a new --run-dir (not {run_dir})")


def check_same_vocabulary(vocab: Vocabulary) -> None:
    """Under torchrun, where every process learned its own: refuse to train unless all learned
    the same vocabulary (a collective: every process calls it).

    Raises:
        UserError: the fingerprints differ; the message says to learn it once with
            ``aiayn vocab`` and pass ``--vocab``.
    """
    prints: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(prints, vocab.fingerprint)
    if len(set(prints)) > 1:  # every process sees all of them: all stop together
        raise UserError("the processes learned different vocabularies from the training data; "
                        "learn it once with `aiayn vocab --src FILE --tgt FILE --size N -o DIR` "
                        "and pass --vocab DIR")


def describe_global_batch(config: Config, world_size: int) -> str:
    """One line for the run's start: the tokens of one update (§5.1's 25000 a side), as
    processes x accumulation steps x each batch's ``data.max_tokens``."""
    d, accum = config.data, config.train.accum_steps
    total = world_size * accum * d.max_tokens
    stated = ""
    if d.global_max_tokens:
        stated = (f" (data.global_max_tokens = {d.global_max_tokens}"
                  + (", rounded down to a whole share)" if total != d.global_max_tokens
                     else ")"))
    return (f"global batch {world_size} process(es) x {accum} accumulation step(s) x "
            f"{d.max_tokens} tokens = at most {total} tokens a side an update{stated}")


def _check_trainable(train: Any, pairs: int, dropped_empty: int, where: str,
                     data: Any) -> None:
    """Fail at once, saying why, when no training batch can exist (instead of a loop that
    never finds one). ``pairs``: the non-empty pairs ``train`` was made from."""
    if data.dataset == "files" and not data.prepared:
        where = f"{data.train_src} and {data.train_tgt}"
    if pairs == 0:
        raise UserError(f"{where}: no training pairs (every line pair is empty: "
                        f"{dropped_empty} dropped)")
    if len(train) == 0:
        raise UserError(f"{where}: none of the {pairs} training pairs fits "
                        f"data.max_len={data.max_len} tokens (source or target + EOS); "
                        "raise data.max_len")
    longest = int(max(train.src_lengths().max(), train.tgt_lengths().max()))
    if longest > data.max_tokens:
        raise UserError(f"{where}: a pair of {longest} tokens cannot fit a batch of "
                        f"data.max_tokens={data.max_tokens}; raise data.max_tokens or lower "
                        f"data.max_len (now {data.max_len})")


def _dist_settings(config: Config | None, run_dir: Path, resume: bool,
                   overrides: list[str] | None) -> TrainConfig:
    """The training settings that say how to join the process group, before it is joined: on
    ``resume`` the run's saved config with ``overrides`` (when it can be read; the resume's own
    checks report a missing or damaged one), else ``config``'s."""
    saved = RunDir(run_dir).config
    if resume and saved.is_file():
        try:
            cfg = Config.from_dict(read_json_object(saved), source=str(saved))
            return (cfg.with_overrides(overrides) if overrides else cfg).train
        except UserError:
            pass
    return config.train if config is not None else TrainConfig()


def training_data(config: Config, vocab: Any, vocab_path: str | Path | None, run_dir: Path,
                  resume: bool, info: Any, log: Any, early_text: ParallelCorpus | None = None,
                  early_vocab: Vocabulary | None = None
                  ) -> tuple[Any, Any, ParallelCorpus | None]:
    """(vocabulary, training pairs, their text) of a run: the pairs as a memory-mapped
    :class:`~aiayn.data.prepared.PreparedCorpus`, read from ``data.prepared`` or prepared
    from the raw files into the cache (:func:`~aiayn.data.prepared.prepare_for_training`);
    with ``data.bpe_dropout`` encoded in memory with their text (re-segmented every epoch).

    Without ``vocab`` or ``vocab_path`` the vocabulary is the prepared folder's, or is learned
    from a sample of the training text (:func:`learn_vocabulary`); under torchrun every
    process has learned it before joining the group (``early_text``, ``early_vocab``) and
    all must agree (:func:`check_same_vocabulary`). A resumed run must train on the data its
    ``data.json`` names.

    Raises:
        UserError: no usable pair, a vocabulary that does not match the prepared ids, data
            that changed since the run started (naming what changed).
    """
    from aiayn.data import prepared as prep

    data = config.data
    text = None
    if data.prepared:
        train = prep.PreparedCorpus.open(data.prepared)
        if data.bpe_dropout > 0:
            raise UserError(f"data.prepared = {data.prepared}: BPE-dropout re-segments the "
                            "text every epoch; train on the raw files for data.bpe_dropout")
        if vocab is None:
            vocab = Vocabulary.load(vocab_path) if vocab_path else train.load_vocabulary()
        train.check_vocabulary(vocab, str(vocab_path) if vocab_path else "the vocabulary")
        prep.check_settings(train, data)
    else:
        if (vocab is None and not vocab_path) or data.bpe_dropout > 0:
            # train_limit already applied
            text = early_text if early_text is not None else load_split(data, "train")
            if len(text) == 0:
                _check_trainable([], 0, text.dropped_empty, text.name, data)
        if vocab is None:
            if vocab_path:
                vocab = Vocabulary.load(vocab_path)
            else:
                vocab = early_vocab or learn_vocabulary(text, data, log, "aiayn train")
                if info.world_size > 1:
                    check_same_vocabulary(vocab)
        if data.bpe_dropout > 0:
            train = encode_corpus(vocab, text, data.max_len)
            _check_trainable(train, len(text), text.dropped_empty, text.name, data)
            return vocab, train, text
        src, tgt = split_paths(data, "train")
        settings = prep.Settings(data.src_lang, data.tgt_lang, data.preprocess, data.max_len,
                                 limit=data.train_limit)
        train = prep.prepare_for_training(src, tgt, vocab, settings, info, log)
    counts = train.manifest["counts"]
    _check_trainable(train, counts["lines"] - counts["empty"], counts["empty"], train.name,
                     data)
    if resume:
        prep.check_run_data(run_dir, train)
    return vocab, train, text


def summary_line(summary: dict[str, Any]) -> str:
    """The line ``aiayn train`` (and an ensemble member's process) ends with: its summary as
    ``key=value`` pairs, floats to 4 significant digits."""
    return "aiayn train: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in summary.items())


def resolve_resume(resume: bool | str, config: Config | None, run_dir: Path) -> bool | str:
    """``resume`` (``--resume``: True, False or "auto") with the config's ``train.resume``:
    "auto" when either asks for it, so one command starts a run and continues it after a
    restart (torchrun ``--max-restarts``, a requeued job).

    Raises:
        UserError: "auto" without a config to start from.
    """
    if resume is True:
        return True
    if resume == "auto" or (config is not None and config.train.resume == "auto"):
        if config is None:
            raise UserError(f"--resume auto starts a fresh run when {run_dir} holds no "
                            "checkpoint: give its --preset or --config")
        return "auto"
    return False


def visible_checkpoint(run_dir: Path, name: str, info: DistInfo,
                       wait_s: float = 60.0) -> Path:
    """``run_dir``'s checkpoint ``name`` (the main process's newest), once this process sees
    it complete: a shared filesystem may show another node a new folder some seconds late.

    Raises:
        UserError: still not seen after ``wait_s`` seconds (naming the node and the folder).
    """
    import socket
    import time

    deadline = time.monotonic() + wait_s
    while True:
        found = {p.name: p for p in list_checkpoints(run_dir)}
        if name in found:
            return found[name]
        if time.monotonic() > deadline:
            raise UserError(f"{RunDir(run_dir).checkpoints / name}: the main process resumes "
                            f"from it, but node {info.node} ({socket.gethostname()}) does not "
                            f"see it after {wait_s:.0f} s; every node must see the one run "
                            "folder (a shared filesystem)")
        time.sleep(1.0)


def keep_global_batch(config: Config, checkpoint: Path, world_size: int, log: Any) -> Config:
    """``config`` for resuming ``checkpoint`` on ``world_size`` processes: when the number of
    processes changed, ``train.accum_steps`` chosen so that an update holds the checkpoint's
    batches (processes x accumulation steps), so the run continues with the same global
    batches (§5.1's 25000 tokens stay 25000), from the same global position in the epoch.

    Raises:
        UserError: ``world_size`` does not divide the batches of an update, or a
            ``train.accum_steps`` given with ``--set`` changes them (naming what fits).
    """
    meta = read_meta(checkpoint)
    old_world, per_update = meta.get("world_size"), meta.get("batches_per_update")
    if old_world is None or per_update is None or old_world == world_size:
        return config  # the Learner checks the training state itself
    accum = config.train.accum_steps
    if accum == per_update // old_world and per_update % world_size == 0:
        accum = per_update // world_size
    check_same_update({"world_size": old_world, "batches_per_update": per_update}, world_size,
                      accum, str(checkpoint))
    log(f"aiayn train: resuming a run of {old_world} process(es) on {world_size}: "
        f"train.accum_steps {config.train.accum_steps} -> {accum}, so that an update holds "
        f"the same {per_update} batches (the global batch and its place in the epoch kept)")
    return config.replace(train=dataclasses.replace(config.train, accum_steps=accum))


def run_training(
    config: Config | None,
    run_dir: str | Path,
    *,
    vocab_path: str | Path | None = None,
    resume: bool | str = False,
    overrides: list[str] | None = None,
    device: str | None = None,
    progress: bool = True,
    log: Any = None,
    init_from: str | Path | None = None,
) -> dict[str, Any]:
    """Train ``config`` into ``run_dir`` (or resume the run there) and return the summary.

    With ``init_from`` (a checkpoint, a run directory or a Hugging Face Marian directory:
    whatever :meth:`aiayn.Translator.from_pretrained` loads as one model), training starts
    from that model's weights and vocabulary, with a fresh optimizer and schedule (fine-tuning):
    the architecture, ``data.preprocess`` and decode settings are the model's; dropout, data
    and training settings are ``config``'s.

    With ``resume="auto"`` (or ``config.train.resume = "auto"``) the run resumes when
    ``run_dir`` holds a checkpoint and starts afresh from ``config`` when it holds none (then
    ``overrides`` apply to the resumed run, as with ``resume=True``). A run resumed on another
    number of processes keeps its global batch (:func:`keep_global_batch`). Under torchrun on
    several nodes, every node must see the one ``run_dir``
    (:func:`~aiayn.training.distributed.check_shared_run_dir`).

    Without ``vocab_path`` a vocabulary of ``data.vocab_size`` is learned from the training
    pairs; ``model.vocab_size`` is then set to its real size. Everything is checked before
    anything is written: ``config.json`` and ``tokenizer.json`` are written into ``run_dir``
    once the data is loaded and (when resuming) the checkpoint has been restored.

    Raises:
        UserError: resuming without a checkpoint, starting over one, ``run_dir`` an existing
            file or not shared by the nodes, a resume that changes the model's shape or (on
            another number of processes) the global batch, no usable training pair, a device
            this machine lacks.
    """
    log = log or logger.info
    run_dir = Path(run_dir)
    info = DistInfo.from_env()
    dev = choose_device(device, info.local_rank)
    check_output_dir(run_dir, "--run-dir")
    prepare_training_process(dev)
    auto = resolve_resume(resume, config, run_dir) == "auto"
    if auto:  # decided again, by the main process, once the run folder is recovered
        resume = bool(list_checkpoints(run_dir))
    if config is not None and not resume:  # a global batch that cannot be shared out fails
        # before any work
        batch_tokens_per_process(config.data, info.world_size, config.train.accum_steps)
    early_text = early_vocab = None
    if (info.world_size > 1 and not resume and init_from is None and not vocab_path
            and config is not None and not config.data.prepared):
        # every process learns the vocabulary itself, before it joins the process group: the
        # same sample gives the same vocabulary (checked in training_data), and no process
        # waits at a barrier, under the backend's timeout, while another one learns
        early_text = load_split(config.data, "train")
        if len(early_text):
            early_vocab = learn_vocabulary(early_text, config.data,
                                           log if info.is_main else None, "aiayn train")
    tc = _dist_settings(config, run_dir, resume, overrides)
    init_distributed(dev, tc.dist_backend, tc.dist_timeout_s)  # the one place a group is joined
    check_shared_run_dir(run_dir, info)
    if info.is_main and run_dir.is_dir():
        for line in recover_run_dir(run_dir):
            log(f"aiayn train: {line}")
    if info.world_size > 1:
        dist.barrier()
    # the main process's newest checkpoint, for all: another node's view of a shared folder
    # can lag behind (NFS caches directory listings), and every process must resume one step
    found = list_checkpoints(run_dir)
    newest = main_choice(found[-1].name if found else "", info)
    if auto:
        resume = bool(newest)
        if info.is_main and not resume:
            log(f"aiayn train: --resume auto: no checkpoint in {run_dir}, starting afresh")
    resume_from = None
    vocab = None
    if resume:
        if not newest:
            raise UserError(f"--resume: no checkpoint in {RunDir(run_dir).checkpoints}")
        resume_from = visible_checkpoint(run_dir, newest, info)
        saved = Config.from_dict(read_json_object(RunDir(run_dir).config),
                                 source=str(RunDir(run_dir).config))
        config = saved.with_overrides(overrides) if overrides else saved  # e.g. more steps
        check_resume_overrides(saved, config, run_dir)
        config = keep_global_batch(config, resume_from, info.world_size,
                                   log if info.is_main else _quiet)
        vocab = Vocabulary.load(run_dir)
    elif newest:
        raise UserError(f"{run_dir} already holds checkpoints: add --resume to continue that "
                        "run, or choose another --run-dir")
    assert config is not None
    start_model = None
    if init_from is not None and not resume:
        start_model, config, vocab = _initial_model(init_from, config, dev, log)
    per_process = batch_tokens_per_process(config.data, info.world_size,
                                           config.train.accum_steps)
    if per_process != config.data.max_tokens:  # the run's config.json records what it used
        config = config.replace(data=dataclasses.replace(config.data, max_tokens=per_process))
    if config.data.prepared:  # recorded absolute: a resume from another folder finds it
        config = config.replace(data=dataclasses.replace(
            config.data, prepared=os.path.abspath(config.data.prepared)))
    vocab, train, train_text = training_data(config, vocab, vocab_path, run_dir, resume, info,
                                             log, early_text, early_vocab)
    early_text = None  # the text the vocabulary was learned from; train_text keeps what it needs
    if start_model is None and not resume:
        config = sized_to(config, vocab)
    valid_corpus = load_split(config.data, "valid")
    valid_enc = encode_corpus(vocab, valid_corpus, config.data.max_len) if valid_corpus else None
    trainer = Trainer(config, run_dir, vocab, train, valid_corpus, valid_enc, dev,
                      progress=progress, train_text=train_text, model=start_model,
                      resume_from=resume_from)
    if auto and not resume:  # an attempt killed before its first checkpoint logged steps
        trainer.metrics_dropped = trainer.metrics.rewind(0)
    if info.is_main:  # validated and restored: only now is anything written
        run_dir.mkdir(parents=True, exist_ok=True)
        vocab.save(run_dir)
        write_json_atomic(RunDir(run_dir).config, config.to_dict())
        if hasattr(train, "manifest"):
            from aiayn.data.prepared import record_run_data

            record_run_data(run_dir, train)
        dropped_empty = train_text.dropped_empty if train_text else train.dropped_empty
        log(f"aiayn train: {len(train)} training pairs ({train.filtered} over "
            f"{config.data.max_len} tokens dropped, {dropped_empty} empty dropped), "
            f"vocabulary {len(vocab)}, {info.world_size} process(es) on {dev}, "
            f"run dir {run_dir}")
        log(f"aiayn train: {describe_global_batch(config, info.world_size)}")
        if restart_warning():
            log(f"aiayn train: {restart_warning()}")
        if info.world_size > 1:
            ddp = describe_data_parallel(trainer.learner.compute_model, config.train)
            log(f"aiayn train: {ddp}")
        log(f"aiayn train: {trainer.precision.describe()}")
        if config.model.output_vocab == "target":  # the bias limit_output_vocab set
            bias = trainer.model.final_logits_bias
            log(f"aiayn train: output vocabulary {int(torch.isfinite(bias).sum())} of "
                f"{bias.numel()} tokens (those of the training targets, and EOS)")
        if config.data.bpe_dropout > 0:
            log(f"aiayn train: BPE-dropout {config.data.bpe_dropout}: the training pairs are "
                "segmented anew every epoch (validation and decoding keep the vocabulary's own "
                "segmentation)")
        if config.train.ema_decay > 0:
            log(f"aiayn train: a moving average of the weights (decay {config.train.ema_decay}) "
                f"goes to {RunDir(run_dir).ema} when training ends")
        if config.train.late_dropout_start > 0:
            log(f"aiayn train: late dropout: no dropout until "
                f"{config.train.late_dropout_start:.0%} of the budget is spent, then P_drop "
                f"{config.model.P_drop}, attention dropout {config.model.attention_dropout}, "
                f"word dropout {config.model.word_dropout}")
        if config.train.rdrop_alpha > 0:
            # no dropout masks before late dropout's start, so no second pass either
            start = max(config.train.rdrop_start, config.train.late_dropout_start)
            when = (f"once {start:.0%} of the budget is spent, " if start > 0 else "")
            log(f"aiayn train: R-Drop: {when}every batch runs through the model twice, the loss "
                f"adds {config.train.rdrop_alpha} x the symmetric KL of the two outputs")
            if not config.model.has_dropout:
                log("aiayn train: warning: every dropout rate is 0, so R-Drop's two passes "
                    "would be the same pass: training runs one pass, and R-Drop does nothing "
                    "(set model.P_drop > 0 for it, or train.rdrop_alpha = 0)")
        if config.train.weight_decay > 0:
            kind = ("decoupled (AdamW), on the matrices and embeddings"
                    if config.train.decoupled_weight_decay else "an L2 term in Adam's gradient")
            log(f"aiayn train: weight decay {config.train.weight_decay}, {kind}")
        if resume_from is not None:
            dropped = (f"; {trainer.metrics_dropped} {METRICS} line(s) of the steps after "
                       "it dropped, as they are trained again" if trainer.metrics_dropped else "")
            log(f"aiayn train: resumed from {resume_from} (step {trainer.state.step}){dropped}")
        elif trainer.metrics_dropped:
            log(f"aiayn train: {trainer.metrics_dropped} {METRICS} line(s) of an attempt that "
                "wrote no checkpoint dropped, as its steps are trained again")
    try:
        return trainer.fit()
    finally:
        if dist.is_initialized():
            trainer.learner.release_process_group()
            dist.destroy_process_group()
