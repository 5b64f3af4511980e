"""Table 1 (§4) measured: one layer of each kind, forward and backward, at growing n.

Layers (d = d_model, batch 1):
- self-attention: :class:`~aiayn.model.MultiHeadAttention` over all n positions;
- restricted self-attention: the same layer, each query seeing only the 2r + 1 keys around it,
  computed on those windows (:func:`local_attention`), so its cost grows as r · n · d; the
  model's training path applies the same band as a mask (:func:`~aiayn.model.transformer.
  band_mask`), which gives identical outputs (the tests check it) but costs n² like full
  attention;
- recurrent: ``torch.nn.LSTM(d, d)``;
- convolutional: ``torch.nn.Conv1d(d, d, k)``, same padding.

For each: median wall time of forward + backward, the memory saved for backward (activations
autograd keeps, counted per storage; on CUDA also the peak the allocator saw), and the number of
sequential operations (dependent steps: n for the recurrence, 1 otherwise). The growth exponent
in n is the least-squares slope of log(time) on log(n) over the largest n.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.fileio import save_with

# The paper's Table 1: complexity per layer, sequential operations, maximum path length.
PAPER_TABLE1 = {
    "self-attention": ("O(n²·d)", "O(1)", "O(1)", 2.0),
    "restricted self-attention": ("O(r·n·d)", "O(1)", "O(n/r)", 1.0),
    "recurrent": ("O(n·d²)", "O(n)", "O(n)", 1.0),
    "convolutional": ("O(k·n·d²)", "O(1)", "O(log_k(n))", 1.0),
}
LAYERS = tuple(PAPER_TABLE1)


def local_attention(q: Tensor, k: Tensor, v: Tensor, r: int) -> Tensor:
    """Eq. 1 restricted to the 2r + 1 keys around each query (§4), on windows.

    Args:
        q, k: (B, h, n, d_k); v: (B, h, n, d_v); r >= 1.

    Returns:
        (B, h, n, d_v), equal to attention under ``band_mask(n, n, r, causal=False)``.
    """
    n = q.shape[2]
    w = 2 * r + 1
    kp = F.pad(k, (0, 0, r, r)).unfold(2, w, 1)  # (B, h, n, d_k, w)
    vp = F.pad(v, (0, 0, r, r)).unfold(2, w, 1)  # (B, h, n, d_v, w)
    scores = torch.einsum("bhnd,bhndw->bhnw", q, kp) / math.sqrt(q.shape[-1])
    pos = torch.arange(n, device=q.device)[:, None] + torch.arange(w, device=q.device) - r
    scores = scores.masked_fill((pos < 0) | (pos >= n), float("-inf"))  # padding keys
    return torch.einsum("bhnw,bhndw->bhnd", scores.softmax(dim=-1), vp)


class _Attention(nn.Module):
    def __init__(self, d: int, h: int, r: int | None) -> None:
        super().__init__()
        from aiayn.model import MultiHeadAttention

        self.mha = MultiHeadAttention(d, h, d // h, d // h)
        self.r = r

    def forward(self, x: Tensor) -> Tensor:
        m = self.mha
        if self.r is None:
            return m(x, m.project_kv(x))
        q = m._split(m.W_q(x), m.d_k)
        k, v = m.project_kv(x)
        out = local_attention(q, k, v, self.r)
        B, _, n, _ = out.shape
        return m.W_o(out.transpose(1, 2).reshape(B, n, m.h * m.d_v))


class _Recurrent(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d, d, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.lstm(x)[0]


class _Convolutional(nn.Module):
    def __init__(self, d: int, k: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(d, d, k, padding=k // 2)

    def forward(self, x: Tensor) -> Tensor:  # (B, n, d) -> (B, n, d)
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


def make_layer(kind: str, d: int, *, h: int = 8, r: int = 16, k: int = 3) -> nn.Module:
    """One layer of Table 1's ``kind``, mapping (B, n, d) to (B, n, d).

    Raises:
        ValueError: unknown kind, or h not dividing d.
    """
    if d % h:
        raise ValueError(f"h={h} must divide d={d}")
    if kind == "self-attention":
        return _Attention(d, h, None)
    if kind == "restricted self-attention":
        return _Attention(d, h, r)
    if kind == "recurrent":
        return _Recurrent(d)
    if kind == "convolutional":
        return _Convolutional(d, k)
    raise ValueError(f"unknown layer kind {kind!r}; known: {', '.join(LAYERS)}")


def sequential_operations(kind: str, n: int) -> int:
    """Dependent steps the layer takes over n positions (Table 1's middle column)."""
    return n if kind == "recurrent" else 1


def _saved_bytes(fn: Callable[[], Tensor], params: set[int]) -> tuple[Tensor, int]:
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def measure(kind: str, n: int, d: int = 512, *, h: int = 8, r: int = 16, k: int = 3,
            repeats: int = 3, device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    """Time forward + backward of one layer on a (1, n, d) input.

    Returns:
        dict with kind, n, d, time_s (median of ``repeats``), saved_bytes (activations kept
        for backward), peak_bytes (CUDA only, else None) and sequential_ops.
    """
    torch.manual_seed(seed)
    layer = make_layer(kind, d, h=h, r=r, k=k).to(device)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    x = torch.randn(1, n, d, device=device, requires_grad=True)
    times, saved, peak = [], 0, None
    for i in range(repeats + 1):  # the first run warms up and is not timed
        layer.zero_grad(set_to_none=True)
        x.grad = None
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out, saved = _saved_bytes(lambda: layer(x), params)
        out.sum().backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        if i:
            times.append(time.perf_counter() - t0)
    return {"kind": kind, "n": n, "d": d, "r": r, "k": k, "time_s": statistics.median(times),
            "saved_bytes": saved, "peak_bytes": peak,
            "sequential_ops": sequential_operations(kind, n)}


def fit_exponent(ns: list[int], values: list[float], top: int = 4) -> float:
    """Least-squares slope of log(value) on log(n) over the ``top`` largest n (the asymptotic
    regime; at small n fixed costs hide the growth).

    Raises:
        ValueError: fewer than two points, or a value that is not positive.
    """
    pairs = sorted(zip(ns, values))[-top:]
    if len(pairs) < 2 or any(v <= 0 or x <= 0 for x, v in pairs):
        raise ValueError(f"need two or more positive points to fit, got {pairs}")
    xs = [math.log(x) for x, _ in pairs]
    ys = [math.log(v) for _, v in pairs]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)


def summarize(records: list[dict[str, Any]], top: int = 4) -> list[dict[str, Any]]:
    """Per layer kind: the paper's columns and the measured exponents of time and memory."""
    rows = []
    for kind in LAYERS:
        mine = [r for r in records if r["kind"] == kind]
        if len(mine) < 2:
            continue
        ns = [r["n"] for r in mine]
        complexity, seq, path, expected = PAPER_TABLE1[kind]
        rows.append({
            "kind": kind, "complexity": complexity, "sequential_ops": seq, "path_length": path,
            "expected_exponent": expected,
            "time_exponent": round(fit_exponent(ns, [r["time_s"] for r in mine], top), 2),
            "memory_exponent": round(fit_exponent(ns, [max(r["saved_bytes"], 1) for r in mine],
                                                  top), 2),
            "measured_sequential_ops": f"{mine[-1]['sequential_ops']} at n={mine[-1]['n']}",
        })
    return rows


def markdown(summary: list[dict[str, Any]]) -> str:
    head = ("| layer type | complexity per layer | sequential operations | maximum path length "
            "| time exponent in n (measured) | memory exponent in n (measured) |")
    lines = [head, "|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['kind']} | {s['complexity']} | {s['sequential_ops']} | "
                     f"{s['path_length']} | {s['time_exponent']:.2f} (paper: "
                     f"{s['expected_exponent']:.0f}) | {s['memory_exponent']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(records: list[dict[str, Any]], summary: list[dict[str, Any]], path: Any,
         title: str = "") -> Any:
    """Log-log time and memory against n, one line per layer kind."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    slope = {s["kind"]: s for s in summary}
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), dpi=100)
    for kind in LAYERS:
        mine = sorted((r for r in records if r["kind"] == kind), key=lambda r: r["n"])
        if not mine or kind not in slope:
            continue
        ns = [r["n"] for r in mine]
        axes[0].loglog(ns, [r["time_s"] for r in mine], "o-", ms=3,
                       label=f"{kind} (slope {slope[kind]['time_exponent']:.2f})")
        axes[1].loglog(ns, [max(r["saved_bytes"], 1) / 2**20 for r in mine], "o-", ms=3,
                       label=f"{kind} (slope {slope[kind]['memory_exponent']:.2f})")
    axes[0].set(xlabel="n (positions)", ylabel="forward + backward time (s)")
    axes[1].set(xlabel="n (positions)", ylabel="activations saved for backward (MiB)")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title or "Table 1 measured", fontsize=9)
    fig.tight_layout()
    try:
        return save_with(path, fig.savefig)
    finally:
        plt.close(fig)
