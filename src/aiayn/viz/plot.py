"""Drawings of attention weights (matplotlib, written as PNG).

* :func:`draw_lines`, the style of the paper's Figures 3-5: the query tokens in a left column,
  the key tokens in a right column, a line from each query to each key whose opacity is the
  weight, one colour per head (several heads overlay in one panel, as in Figure 3).
* :func:`draw_heatmaps`: one heat map per head, queries down, keys across, subword tokens on
  both axes.
"""

from __future__ import annotations

from pathlib import Path

from aiayn.fileio import save_with
from aiayn.viz.attention import AttentionMaps

KIND_TITLES = {"encoder": "encoder self-attention", "decoder": "decoder self-attention (masked)",
               "cross": "encoder-decoder attention"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def display_tokens(tokens: list[str]) -> list[str]:
    """Subwords as a reader expects them: the word-start marker ``▁`` dropped, a piece that
    continues a word shown with a leading ``-`` (``▁bi``, ``ke`` -> ``bi``, ``-ke``)."""
    out = []
    for tok in tokens:
        if tok.startswith("<") and tok.endswith(">"):
            out.append(tok)
        elif tok.startswith("\u2581"):
            out.append(tok[1:] or "\u2581")
        else:
            out.append("-" + tok)
    return out


def _check(maps: AttentionMaps, kind: str, layer: int, heads: list[int]) -> None:
    N, h = maps.of(kind).shape[:2]
    if not 0 <= layer < N:
        raise ValueError(f"layer {layer + 1} does not exist: the model has N={N} layers "
                         f"(1 … {N})")
    bad = [x + 1 for x in heads if not 0 <= x < h]
    if bad or not heads:
        raise ValueError(f"head {bad[0] if bad else '?'} does not exist: the model has h={h} "
                         f"heads (1 … {h})")


def _save(fig, path: str | Path) -> Path:
    """Write ``fig`` as PNG atomically (:func:`aiayn.fileio.save_with`) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return save_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=fig.dpi,
                                                       bbox_inches="tight"))
    finally:
        _pyplot().close(fig)


def _title(maps: AttentionMaps, kind: str, layer: int, heads: list[int], n_heads: int) -> str:
    which = "all heads" if len(heads) == n_heads and n_heads > 1 else \
        "head" + ("s " if len(heads) > 1 else " ") + ", ".join(str(x + 1) for x in heads)
    N = maps.of(kind).shape[0]
    return f"{KIND_TITLES[kind]}, layer {layer + 1} of {N}, {which}"


def draw_lines(maps: AttentionMaps, kind: str, layer: int, heads: list[int],
               path: str | Path) -> Path:
    """The paper's style (Figures 3-5): two columns of tokens joined by lines.

    Args:
        maps: from :func:`~aiayn.viz.attention.attention_maps`.
        kind: ``encoder``, ``decoder`` or ``cross``.
        layer: 0-based layer; heads: 0-based heads, each drawn in its own colour.
        path: the PNG to write (atomically).

    Returns: ``path``.

    Raises:
        ValueError: a layer or head the model does not have.
    """
    _check(maps, kind, layer, heads)
    plt = _pyplot()
    weights = maps.of(kind)[layer]  # (h, Tq, Tk)
    queries, keys = map(display_tokens, maps.labels(kind))
    rows = max(len(queries), len(keys))
    fig, ax = plt.subplots(figsize=(4.8, 0.8 + 0.26 * rows), dpi=110)
    y_q = [rows - 1 - i * (rows - 1) / max(len(queries) - 1, 1) for i in range(len(queries))]
    y_k = [rows - 1 - j * (rows - 1) / max(len(keys) - 1, 1) for j in range(len(keys))]
    colours = plt.get_cmap("tab10")
    for n, head in enumerate(heads):
        colour = colours(head % 10)
        w = weights[head]
        for i in range(len(queries)):
            for j in range(len(keys)):
                a = float(w[i, j])
                if a >= 0.01:  # below 1% a line is invisible anyway
                    ax.plot([0, 1], [y_q[i], y_k[j]], color=colour, alpha=min(1.0, a),
                            linewidth=2.2, solid_capstyle="butt")
        ax.plot([], [], color=colour, linewidth=3, label=f"head {head + 1}")
    for i, tok in enumerate(queries):
        ax.text(-0.04, y_q[i], tok, ha="right", va="center", fontsize=9)
    for j, tok in enumerate(keys):
        ax.text(1.04, y_k[j], tok, ha="left", va="center", fontsize=9)
    ax.set_xlim(-0.5, 1.5)
    ax.set_ylim(-0.8, rows - 0.2)
    ax.axis("off")
    ax.set_title(_title(maps, kind, layer, heads, weights.shape[0]), fontsize=9)
    if len(heads) > 1:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(len(heads), 4),
                  fontsize=8, frameon=False)
    return _save(fig, path)


def draw_heatmaps(maps: AttentionMaps, kind: str, layer: int, heads: list[int],
                  path: str | Path) -> Path:
    """One heat map per head: rows are queries, columns keys, darker = more weight.

    Arguments and errors as :func:`draw_lines`.
    """
    _check(maps, kind, layer, heads)
    plt = _pyplot()
    weights = maps.of(kind)[layer]
    queries, keys = map(display_tokens, maps.labels(kind))
    cols = min(len(heads), 4)
    grid_rows = (len(heads) + cols - 1) // cols
    cell = 0.22
    fig, axes = plt.subplots(grid_rows, cols, squeeze=False, dpi=110,
                             figsize=(cols * (1.4 + cell * len(keys)),
                                      grid_rows * (1.4 + cell * len(queries))))
    for n, ax in enumerate(axes.flat):
        if n >= len(heads):
            ax.axis("off")
            continue
        image = ax.imshow(weights[heads[n]].numpy(), cmap="Blues", vmin=0.0, vmax=1.0,
                          aspect="equal", interpolation="nearest")
        ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=7)
        ax.set_yticks(range(len(queries)), queries, fontsize=7)
        ax.set_title(f"head {heads[n] + 1}", fontsize=9)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, label="weight")
    fig.suptitle(_title(maps, kind, layer, heads, weights.shape[0]), fontsize=10)
    return _save(fig, path)
