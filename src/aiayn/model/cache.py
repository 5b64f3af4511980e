"""Incremental decoding state (the key/value cache).

For each decoder layer the cache holds the keys and values of decoder self-attention for every
position decoded so far, and the encoder-decoder keys and values, computed once per source.
Beam search reorders it along the batch dimension with :meth:`DecoderCache.index_select`.
Under restricted self-attention (§4, ``attention_window = r``) each layer keeps only the last r
positions, so its memory stays flat however long the output grows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class DecoderCache:
    """Per-layer tensors (shapes use B = batch rows, h heads, t positions cached, S source).

    Attributes:
        self_kv: per layer, keys (B, h, t, d_k) and values (B, h, t, d_v); None before step 1.
        cross: per layer, encoder-decoder keys (B, h, S, d_k) and values (B, h, S, d_v).
        src_mask: bool (B, S), True at real source tokens.
        length: t, the positions decoded so far.
        window: r of restricted self-attention (§4): only the last r positions are kept
            (t above is then at most r); None keeps all.
    """

    self_kv: list[tuple[Tensor, Tensor] | None]
    cross: list[tuple[Tensor, Tensor]]
    src_mask: Tensor
    length: int = 0
    window: int | None = None

    @classmethod
    def start(cls, cross: list[tuple[Tensor, Tensor]], src_mask: Tensor,
              window: int | None = None) -> DecoderCache:
        return cls(self_kv=[None] * len(cross), cross=cross, src_mask=src_mask, window=window)

    def cached_len(self, layer: int) -> int:
        """Positions of ``layer`` held now (the most recent ones; ``length`` when unrestricted)."""
        kv = self.self_kv[layer]
        return 0 if kv is None else kv[0].shape[2]

    def append_self(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append new keys (B, h, t_new, d_k) and values of ``layer``; return the ones held
        before plus the new ones (the keys the new positions may see). With a window r, only
        the last r are kept afterwards."""
        old = self.self_kv[layer]
        if old is not None:
            k = torch.cat([old[0], k], dim=2)
            v = torch.cat([old[1], v], dim=2)
        if self.window is None:
            self.self_kv[layer] = (k, v)
        else:
            self.self_kv[layer] = (k[:, :, -self.window:], v[:, :, -self.window:])
        return k, v

    def index_select(self, index: Tensor) -> DecoderCache:
        """A cache whose row i is row ``index[i]`` of this one (beam reordering, pruning).

        Args:
            index: long (B',) row indices into the current batch.
        """
        pick = lambda kv: (kv[0].index_select(0, index), kv[1].index_select(0, index))  # noqa: E731
        return DecoderCache(
            self_kv=[None if kv is None else pick(kv) for kv in self.self_kv],
            cross=[pick(kv) for kv in self.cross],
            src_mask=self.src_mask.index_select(0, index),
            length=self.length,
            window=self.window,
        )

    @property
    def batch_size(self) -> int:
        return self.src_mask.shape[0]
