"""Incremental decoding state (the key/value cache), the one every search and every step uses.

For each decoder layer the cache holds the keys and values of decoder self-attention for the
positions decoded so far, and the encoder-decoder keys and values, computed once per source.

How it moves data (what makes decoding fast on a CPU):

- **Self-attention keys and values live in preallocated buffers** (rows, h, capacity, d),
  written in place at each step; nothing is concatenated. The buffers hold the longest output
  the caller reserves (:meth:`aiayn.model.engine.CpuEngine.start_cache`'s ``capacity``: the searches reserve
  their length limit), and double when they run out. Growing costs a copy, and the allocator
  may keep the old buffers: with the limit reserved, decoding memory besides the cache stays
  flat in output length (``bench/bench_decode_memory.py``).
- **Encoder-decoder keys and values are kept once per sentence**, never per beam: the
  ``group`` rows of a sentence (its beams) attend to them as ``group`` queries of one
  attention call. Beam search's reorders therefore never copy them.
- **Reordering** (:meth:`select_`, used by the searches) moves, in place, only the rows whose
  history changes, and only the positions held. With ``gather`` (decoding on the CPU through
  :func:`aiayn.model.kernels.attend`) it moves no keys at all: the cache keeps, for every row
  and position, the buffer row that holds that key (:attr:`key_rows`), reorders only that
  table of integers, and the attention reads each key where it lies. Each step writes its new
  keys into buffer rows 0..n-1 at a position nobody has yet, so no history is overwritten.

- **Buffers are reused across batches on the CPU** (:class:`BufferPool`): fresh memory costs a
  page fault per 4 KiB the first time it is written, and a batch's buffers are tens of MiB, so a
  new cache takes the storage of one that no tensor uses any more.
- **An int8 copy keeps its keys and values in bfloat16** (``kv_dtype``; the encoder-decoder
  ones too, :meth:`aiayn.model.engine.CpuEngine.start_cache`): every step reads the whole cache, which with a
  ``base`` model's beams no longer fits the CPU's caches, so halving its bytes made the step
  faster. They are rounded once, when written, as torch rounds, and read exactly (widened);
  every path of that model reads the same rounded keys.

Under restricted self-attention (§4, ``attention_window = r``) each layer keeps only the last
r positions (older ones are dropped, the buffer compacted when it fills), so its memory stays
flat however long the output grows.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from aiayn.model import kernels


class BufferPool:
    """Flat CPU tensors that decoder caches take their self-attention buffers from.

    A pooled tensor is free when nothing but the pool refers to its storage (a cache's buffers
    are views of it, so it is free again once the cache and every view of it are gone); the
    pool never hands out a storage someone still holds. Fresh memory is zeroed by the kernel
    page by page on first touch; reusing it saved about a sixth of decoding time on the main
    job's model (``docs/benchmarks.md``). At most ``max_bytes`` stay pooled (the oldest are
    dropped from the pool first; one still in use stays alive through its views).
    """

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self._tensors: list[Tensor] = []
        self._lock = threading.Lock()

    @staticmethod
    def _free(flat: Tensor) -> bool:
        # 2: the pool's tensor and the storage object made to ask
        return torch._C._storage_Use_Count(flat.untyped_storage()._cdata) <= 2

    def take(self, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """An uninitialized tensor of ``shape``, ``like``'s dtype and device (CPU): a view of a
        free pooled tensor when one is large enough, else a new one (pooled too)."""
        numel = 1
        for dim in shape:
            numel *= dim
        if like.device.type != "cpu":  # a GPU's caching allocator already reuses memory
            return like.new_empty(shape)
        inference = torch.is_inference_mode_enabled()
        with self._lock:
            fits = [t for t in self._tensors
                    if t.dtype == like.dtype and t.numel() >= numel
                    and t.is_inference() == inference and self._free(t)]
            if fits:
                flat = min(fits, key=Tensor.numel)
            else:
                flat = like.new_empty(numel)
                self._tensors.append(flat)
                total = sum(t.numel() * t.element_size() for t in self._tensors)
                while total > self.max_bytes and len(self._tensors) > 1:
                    old = self._tensors.pop(0)
                    total -= old.numel() * old.element_size()
            return flat[:numel].view(shape)

    def clear(self) -> None:
        """Drop every pooled tensor (those in use live on through their views)."""
        with self._lock:
            self._tensors.clear()


#: The pool every :class:`DecoderCache` takes its self-attention buffers from.
BUFFERS = BufferPool()


class DecoderCache:
    """Per-layer cached tensors. Shapes: n = rows (sentences x ``group``), B' = sentences,
    h heads, S source positions.

    Attributes:
        cross: per layer, encoder-decoder keys (B', h, S, d_k) and values (B', h, S, d_v).
        src_mask: bool (B', S), True at real source tokens.
        group: rows per sentence; row r belongs to sentence r // group (the rows of a sentence
            are adjacent, as greedy and beam search keep them).
        length: t, the positions decoded so far.
        window: r of restricted self-attention (§4): only the last r positions are kept;
            None keeps all.
        gather: reorders move the table :attr:`key_rows`, not the keys (see the module
            docstring); only without a window, and only for attention that reads it (the
            model's CPU kernel; other paths gather the rows' keys with :meth:`gathered`).
    """

    def __init__(self, cross: list[tuple[Tensor, Tensor]], src_mask: Tensor, *,
                 window: int | None = None, group: int = 1, capacity: int = 0,
                 gather: bool = False, kv_dtype: torch.dtype | None = None) -> None:
        if gather and window is not None:
            raise ValueError("a gathering cache keeps every position: no window")
        self.cross = cross
        self.gather = gather
        # the self-attention buffers' dtype; None: the new keys' own (torch.bfloat16 halves
        # what each step reads: an int8 copy's cache, aiayn.model.quantize)
        self.kv_dtype = kv_dtype
        self._rows: Tensor | None = None  # gather: (n, C) buffer row of each row's position
        self.src_mask = src_mask
        self.window = window
        self.group = group
        self.length = 0
        self.capacity = capacity  # positions to reserve when the buffers are made
        self._k: list[Tensor | None] = [None] * len(cross)  # (n, h, C, d_k)
        self._v: list[Tensor | None] = [None] * len(cross)
        self._lo = 0  # the positions held are buffer[:, :, _lo : _lo + _held]
        self._held = 0
        self._pending = 0  # positions written in the step now running (until advance)
        self._source_lengths: tuple[Tensor, Tensor | None] | None = None  # (src_mask, lengths)
        self._self_lengths: tuple[int, int, Tensor] | None = None  # (n, t, lengths)
        # what a step function keeps between steps (numpy views of this cache's tensors:
        # aiayn.model.fused), carried through reorders; each entry checks its tensors itself
        self.scratch: dict = {}

    @classmethod
    def start(cls, cross: list[tuple[Tensor, Tensor]], src_mask: Tensor,
              window: int | None = None, capacity: int = 0, gather: bool = False,
              kv_dtype: torch.dtype | None = None) -> DecoderCache:
        """A cache before step 1: one row per sentence of ``src_mask`` (B, S); ``gather``:
        reorder a table of buffer rows instead of the keys (see the module docstring);
        ``kv_dtype``: the self-attention buffers' dtype (None: the keys' own)."""
        return cls(cross, src_mask, window=window, capacity=capacity, gather=gather,
                   kv_dtype=kv_dtype)

    @property
    def batch_size(self) -> int:
        """n, the rows."""
        return self.src_mask.shape[0] * self.group

    @property
    def self_kv(self) -> list[tuple[Tensor, Tensor] | None]:
        """Per layer, the keys (n, h, t, d_k) and values (n, h, t, d_v) held (views into the
        buffers; t = ``length``, or at most r under a window); None before step 1."""
        lo, hi = self._lo, self._lo + self._held
        return [None if k is None else self.gathered(k[:, :, lo:hi], v[:, :, lo:hi])
                for k, v in zip(self._k, self._v)]

    @property
    def key_rows(self) -> Tensor | None:
        """Under ``gather``: long (n, t), the buffer row that holds row r's key and value at
        position j (what :meth:`append_self` returns is the buffers, not the rows), the
        positions of the step now running included; else None."""
        if not self.gather or self._rows is None:
            return None
        return self._rows[: self.batch_size, : self._lo + self._held + self._pending]

    def gathered(self, k: Tensor, v: Tensor, rows: Tensor | None = None
                 ) -> tuple[Tensor, Tensor]:
        """The keys and values of the rows themselves, (n, h, t, d), from buffer views
        (n_buf, h, t, d) that :meth:`append_self` returned (a copy under ``gather``; the views
        themselves otherwise). ``rows``: :attr:`key_rows` as it was when they were returned."""
        rows = self.key_rows if rows is None else rows
        if rows is None:
            return k, v
        pos = torch.arange(rows.shape[1], device=rows.device)[None, :]
        return (k.transpose(1, 2)[rows, pos].transpose(1, 2),
                v.transpose(1, 2)[rows, pos].transpose(1, 2))

    def source_lengths(self) -> Tensor | None:
        """:func:`aiayn.model.kernels.prefix_lengths` of :attr:`src_mask`: long (B',), the real
        source tokens of each sentence, or None where they are not a prefix. Computed once per
        source mask, not at every step (a reorder that keeps the sentences keeps it too)."""
        known = self._source_lengths
        if known is None or known[0] is not self.src_mask:
            known = self._source_lengths = (self.src_mask, kernels.prefix_lengths(self.src_mask))
        return known[1]

    def self_lengths(self, n: int, t: int) -> Tensor:
        """long (n,), each entry ``t``: the keys every row's self-attention sees in the step now
        running (no window), made once a step for all the layers."""
        known = self._self_lengths
        if known is None or known[0] != n or known[1] != t:
            known = self._self_lengths = (n, t, torch.full((n,), t, dtype=torch.long))
        return known[2]

    def cached_len(self, layer: int) -> int:
        """Positions of ``layer`` held before the step now running."""
        return 0 if self._k[layer] is None else self._held

    def append_self(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write new keys (n, h, t_new, d_k) and values of ``layer`` after the ones held;
        return the held ones plus the new ones (the keys the new positions may see), as views.
        :meth:`advance` ends the step for all layers."""
        t_new = k.shape[2]
        if layer == 0 or self._k[layer] is None:
            self._make_room(t_new, k.shape[0], k.shape[1], k.shape[3], v.shape[3], k)
        at = self._lo + self._held
        kb, vb = self._k[layer], self._v[layer]
        n = k.shape[0]
        kb[:n, :, at : at + t_new] = k
        vb[:n, :, at : at + t_new] = v
        if self.gather and layer == 0:  # the new positions lie in the rows' own buffer rows
            self._rows[:n, at : at + t_new] = torch.arange(n, device=k.device)[:, None]
            self._pending = t_new
        return kb[:, :, self._lo : at + t_new], vb[:, :, self._lo : at + t_new]

    def begin_step(self, n: int, h: int, d_k: int, d_v: int, like: Tensor
                   ) -> tuple[int, Tensor]:
        """Start a step of one position for ``n`` rows of a gathering cache without a window,
        whose keys and values the caller writes into :meth:`buffers` itself (what
        :meth:`append_self` does for every layer): room is made, each row's new position lies
        in its own buffer row. Returns the position to write, p (the step's keys are positions
        0 .. p), and the table of buffer rows, long (R', C): its rows :n and positions :p + 1
        are :attr:`key_rows`. :meth:`advance` ends the step."""
        if not self.gather or self.window is not None:
            raise ValueError("begin_step needs a gathering cache without a window")
        self._make_room(1, n, h, d_k, d_v, like)
        at = self._lo + self._held
        self._rows[:n, at] = torch.arange(n, device=like.device)
        self._pending = 1
        return at, self._rows

    def buffers(self, layer: int) -> tuple[Tensor, Tensor]:
        """The self-attention buffers of ``layer``: keys (R, h, C, d_k) and values
        (R, h, C, d_v), R >= n buffer rows, C positions reserved (see :attr:`key_rows`)."""
        return self._k[layer], self._v[layer]

    def advance(self, t_new: int) -> None:
        """End a step of ``t_new`` positions: they are held from now on (under a window, only
        the last r of everything)."""
        self.length += t_new
        self._held += t_new
        self._pending = 0
        if self.window is not None and self._held > self.window:
            self._lo += self._held - self.window
            self._held = self.window

    def _make_room(self, t_new: int, n: int, h: int, d_k: int, d_v: int, like: Tensor) -> None:
        if self.kv_dtype is not None and like.dtype != self.kv_dtype:
            like = like.new_empty(0, dtype=self.kv_dtype)
        need = self._held + t_new
        first = self._k[0]
        if first is not None and self._lo + need <= first.shape[2]:
            return
        if first is None:  # the reservation
            capacity = max(need, self.capacity)
        else:  # compact in place if half is free, else double (up to the reservation)
            size = first.shape[2]
            capacity = size if need <= size // 2 else max(need, 2 * size)
            if self.capacity >= need:
                capacity = min(capacity, max(self.capacity, size))
        if first is not None:  # a gathering cache's buffer may hold more rows than are live
            n = max(n, first.shape[0])
        for i in range(len(self._k)):
            old_k, old_v = self._k[i], self._v[i]
            new_k = BUFFERS.take((n, h, capacity, d_k), like)
            new_v = BUFFERS.take((n, h, capacity, d_v), like)
            if old_k is not None and self._held:
                new_k[:, :, : self._held] = old_k[:, :, self._lo : self._lo + self._held]
                new_v[:, :, : self._held] = old_v[:, :, self._lo : self._lo + self._held]
            self._k[i], self._v[i] = new_k, new_v
        if self.gather:
            live = max(self.batch_size, 0 if self._rows is None else self._rows.shape[0])
            rows = torch.zeros(live, capacity, dtype=torch.long, device=like.device)
            if self._rows is not None and self._held:
                rows[: self._rows.shape[0], : self._held] = self._rows[:, : self._held]
            self._rows = rows
        self._lo = 0

    # --- reordering rows --------------------------------------------------------------------

    def _regroup(self, index: Tensor) -> tuple[list[tuple[Tensor, Tensor]], Tensor, int]:
        """Cross keys/values, source mask and group for rows ``index``: still one copy per
        sentence when the new rows of each sentence are adjacent and equally many."""
        sentence = torch.div(index, self.group, rounding_mode="floor")
        n = sentence.shape[0]
        if n == self.batch_size and torch.equal(  # beams reordered within their sentences:
                sentence, torch.arange(n, device=index.device) // self.group):  # (most steps)
            return self.cross, self.src_mask, self.group
        first = torch.ones(n, dtype=torch.bool, device=index.device)
        first[1:] = sentence[1:] != sentence[:-1]
        starts = first.nonzero().squeeze(1)
        live = sentence.index_select(0, starts)
        g = n // starts.shape[0]
        grouped = (starts.shape[0] * g == n
                   and bool((starts == torch.arange(0, n, g, device=index.device)).all())
                   and bool((live[1:] > live[:-1]).all()))
        pick = live if grouped else sentence
        if grouped and pick.shape[0] == self.src_mask.shape[0]:  # the same sentences, regrouped
            return self.cross, self.src_mask, g
        cross = [(k.index_select(0, pick), v.index_select(0, pick)) for k, v in self.cross]
        return cross, self.src_mask.index_select(0, pick), g if grouped else 1

    def _copy_state(self, cross, src_mask, group) -> DecoderCache:
        out = DecoderCache(cross, src_mask, window=self.window, group=group,
                           capacity=self.capacity, gather=self.gather, kv_dtype=self.kv_dtype)
        out.length, out._lo, out._held = self.length, self._lo, self._held
        out._source_lengths = self._source_lengths  # checked against src_mask when read
        out.scratch = self.scratch
        return out

    def index_select(self, index: Tensor) -> DecoderCache:
        """A new cache whose row i is row ``index[i]`` of this one (this one is unchanged).

        Args:
            index: long (n',) row indices into the current rows (repeats allowed).
        """
        out = self._copy_state(*self._regroup(index))
        lo, hi = self._lo, self._lo + self._held
        rows = self.key_rows
        for i, (k, v) in enumerate(zip(self._k, self._v)):
            if k is None:
                continue
            new_k = k.new_empty(index.shape[0], *k.shape[1:])
            new_v = v.new_empty(index.shape[0], *v.shape[1:])
            held_k, held_v = self.gathered(k[:, :, lo:hi], v[:, :, lo:hi], rows)
            new_k[:, :, lo:hi] = held_k.index_select(0, index)
            new_v[:, :, lo:hi] = held_v.index_select(0, index)
            out._k[i], out._v[i] = new_k, new_v
        if rows is not None:  # each row in its own buffer row again
            out._rows = torch.arange(index.shape[0], device=index.device)[:, None].repeat(
                1, self._rows.shape[1])
        return out

    def select_(self, index: Tensor) -> DecoderCache:
        """Like :meth:`index_select`, but may reuse this cache's buffers: when the rows stay as
        many, only the rows whose history changes are moved, in place. This cache must not be
        used afterwards (the searches never do). Returns the reordered cache."""
        if self.gather and self._k[0] is not None:
            return self._select_rows(index)
        if self._k[0] is None or index.shape[0] != self.batch_size:
            return self.index_select(index)
        out = self._copy_state(*self._regroup(index))
        out._k, out._v = self._k, self._v
        self._k = self._v = []  # poisoned: a use after select_ fails loudly
        n = index.shape[0]
        moved = (index != torch.arange(n, device=index.device)).nonzero().squeeze(1)
        if moved.numel():
            src = index.index_select(0, moved)
            lo, hi = out._lo, out._lo + out._held
            for buf in (*out._k, *out._v):
                held = buf[:, :, lo:hi]
                held.index_copy_(0, moved, held.index_select(0, src))
        return out

    def _select_rows(self, index: Tensor) -> DecoderCache:
        """:meth:`select_` under ``gather``: only the table of buffer rows is reordered; the
        buffers gain rows (a copy) only when there are more rows than ever before."""
        out = self._copy_state(*self._regroup(index))
        n_new, hi = index.shape[0], self._lo + self._held
        k_bufs, v_bufs = self._k, self._v
        rows = self._rows
        if n_new > k_bufs[0].shape[0]:  # more rows than buffer rows (beam expansion)
            grown_k, grown_v = [], []
            for k, v in zip(k_bufs, v_bufs):
                nk = k.new_empty(n_new, *k.shape[1:])
                nv = v.new_empty(n_new, *v.shape[1:])
                nk[: k.shape[0], :, :hi] = k[:, :, :hi]
                nv[: v.shape[0], :, :hi] = v[:, :, :hi]
                grown_k.append(nk)
                grown_v.append(nv)
            k_bufs, v_bufs = grown_k, grown_v
        new_rows = torch.zeros(max(n_new, rows.shape[0]), rows.shape[1], dtype=torch.long,
                               device=rows.device)
        new_rows[:n_new, :hi] = rows[:, :hi].index_select(0, index)
        out._k, out._v, out._rows = k_bufs, v_bufs, new_rows
        self._k = self._v = []  # poisoned: a use after select_ fails loudly
        return out


__all__ = ["DecoderCache"]
