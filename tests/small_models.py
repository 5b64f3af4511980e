"""A small model trained for a few seconds on real Multi30k pairs, shared by tests that need a
trained model's next-token distributions (peaked, not a random model's flat ones)."""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
from pathlib import Path

import torch
import torch.nn.functional as F

from aiayn.config import load_config
from aiayn.data.batching import pad_sources
from aiayn.data.vocab import BOS_ID, EOS_ID, PAD_ID, Vocabulary
from aiayn.model import Transformer


def read_lines(path: Path, n: int) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [next(f).strip() for _ in range(n)]


def train_small(data_dir: Path, *, pairs: int = 600, steps: int = 150, vocab_size: int = 400,
                output_vocab: str = "all"):
    """A 2+2-layer (``tiny`` preset) model trained for ``steps`` updates of 32 pairs (Adam,
    lr 3e-3) on the first ``pairs`` Multi30k en-de training pairs, in eval mode.

    Args:
        output_vocab: ``ModelConfig.output_vocab``; "target" limits the output layer to the
            target side's tokens and EOS (:meth:`Transformer.limit_output_vocab`).

    Returns:
        (model, vocab).
    """
    m30k = data_dir / "multi30k"
    src, tgt = read_lines(m30k / "train.en.gz", pairs), read_lines(m30k / "train.de.gz", pairs)
    vocab = Vocabulary.learn(src + tgt, vocab_size)
    cfg = dataclasses.replace(load_config("tiny").model, vocab_size=len(vocab), max_len=96,
                              output_vocab=output_vocab)
    torch.manual_seed(0)
    model = Transformer(cfg)
    encoded = list(zip(vocab.encode_batch(src), vocab.encode_batch(tgt)))
    if output_vocab == "target":
        model.limit_output_vocab(torch.tensor(sorted({i for _, t in encoded for i in t}
                                                     | {EOS_ID})))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        batch = [encoded[i] for i in torch.randint(len(encoded), (32,), generator=gen).tolist()]
        s = pad_sources([a[:40] + [EOS_ID] for a, _ in batch])
        t = pad_sources([[BOS_ID] + b[:40] + [EOS_ID] for _, b in batch])
        logits = model(s, t[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t[:, 1:].reshape(-1),
                               ignore_index=PAD_ID)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), vocab


def train_copy(data_dir: Path, *, pairs: int = 600, steps: int = 150, vocab_size: int = 400,
               guided_weight: float = 0.0):
    """A 2+2-layer (``tiny`` preset) model trained, as :func:`train_small`, to copy its input:
    each of the first ``pairs`` English Multi30k training sentences is its own target. Its
    outputs are copies, so each output word's source is known (word alignment tests).

    Args:
        guided_weight: > 0: the loss adds guided alignment's term on the last layer's head 0
            (:class:`aiayn.decoding.alignment.GuidedAlignment`, references from IBM Model 1 on
            the copy pairs), with this weight per target token.

    Returns:
        (model, vocab, config): the model in eval mode, and its run config (with the guided
        alignment settings, so that alignments are read at the supervised head).
    """
    from aiayn.config import Config, TrainConfig
    from aiayn.decoding.alignment import GuidedAlignment
    from aiayn.decoding.shortlist import ibm_model1

    src = read_lines(data_dir / "multi30k" / "train.en.gz", pairs)
    vocab = Vocabulary.learn(src, vocab_size)
    cfg = dataclasses.replace(load_config("tiny").model, vocab_size=len(vocab), max_len=96)
    config = Config(name="copy", model=cfg, train=TrainConfig(
        guided_alignment_weight=guided_weight, guided_alignment_layer=-1))
    torch.manual_seed(0)
    model = Transformer(cfg)
    encoded = vocab.encode_batch(src)
    guided = None
    if guided_weight > 0:
        guided = GuidedAlignment(ibm_model1([(a, a) for a in encoded], len(vocab)),
                                 guided_weight, -1, 0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        batch = [encoded[i] for i in torch.randint(len(encoded), (32,), generator=gen).tolist()]
        s = pad_sources([a[:40] + [EOS_ID] for a in batch])
        t = pad_sources([[BOS_ID] + a[:40] + [EOS_ID] for a in batch])
        with guided.capture(model) if guided else contextlib.nullcontext() as found:
            logits = model(s, t[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t[:, 1:].reshape(-1),
                               ignore_index=PAD_ID)
        if guided is not None:
            tokens = int((t[:, 1:] != PAD_ID).sum())
            loss = loss + guided.loss(found["log_attention"], s, t[:, 1:]) / tokens
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), vocab, config
