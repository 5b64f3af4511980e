"""Checkpoint averaging, §6.1: "a single model obtained by averaging the last 5 checkpoints,
which were written at 10-minute intervals" (base) or the last 20 (big).

Which checkpoints: the last K (:func:`select_checkpoints` with ``last``), or those of a span
of updates (``updates`` or ``last_updates``): the paper's 10 minutes were about 1,400 base
updates (600 big), so its average spanned about 5,600 updates (11,400 big) whatever the
machine; a faster GPU that writes one every 10 minutes averages over a far longer span.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from aiayn.checkpoint import load_checkpoint, read_meta, save_checkpoint
from aiayn.errors import UserError
from aiayn.rundir import CHECKPOINTS, META, WEIGHTS, step_number


def parse_update_range(text: str) -> tuple[int | None, int | None]:
    """``"94000:100000"`` (both ends included), ``"94000:"`` or ``":100000"`` as (first, last),
    None for an open end.

    Raises:
        UserError: not of that form, a negative number, or first > last, naming ``text``.
    """
    first, sep, last = text.partition(":")
    try:
        if not sep:
            raise ValueError
        ends = tuple(int(x) if x.strip() else None for x in (first, last))
    except ValueError:
        raise UserError(f"--updates {text!r}: expected FIRST:LAST in updates, such as "
                        "94000:100000 (either end may be left out)") from None
    if any(x is not None and x < 0 for x in ends) or \
            (None not in ends and ends[0] > ends[1]):
        raise UserError(f"--updates {text!r}: expected 0 <= FIRST <= LAST")
    return ends


def select_checkpoints(steps: list[Path], *, last: int | None = None,
                       updates: tuple[int | None, int | None] | None = None,
                       last_updates: int | None = None) -> list[Path]:
    """The step checkpoints to average, oldest first, by one rule:

    - ``last``: the newest K;
    - ``updates``: those whose update (N of ``step-N``) is within (first, last), both ends
      included, None for an open end (:func:`parse_update_range`);
    - ``last_updates``: those of the last U updates, N >= newest N - U (base: 5,600 gives the
      five checkpoints of §6.1 at ``train.checkpoint_every_steps`` = 1,400).

    Args:
        steps: a run's step checkpoints, oldest first (:meth:`aiayn.rundir.RunDir.steps`).

    Raises:
        UserError: not exactly one rule, a count under 1 (``last``) or 0 (``last_updates``),
            or no checkpoint within the span (naming it and the updates there are).
    """
    given = [x is not None for x in (last, updates, last_updates)]
    if sum(given) != 1:
        raise UserError("give one of --last, --updates and --last-updates")
    if not steps:
        raise UserError("no checkpoints to average")
    if last is not None:
        if last < 1:
            raise UserError(f"--last must be at least 1, got {last}")
        return steps[-last:]
    numbers = [step_number(p) for p in steps]
    if last_updates is not None:
        if last_updates < 0:
            raise UserError(f"--last-updates must be at least 0, got {last_updates}")
        first, end, what = numbers[-1] - last_updates, numbers[-1], \
            f"--last-updates {last_updates}"
    else:
        assert updates is not None
        first, end = updates
        what = f"--updates {'' if first is None else first}:{'' if end is None else end}"
    chosen = [p for p, n in zip(steps, numbers)
              if (first is None or n >= first) and (end is None or n <= end)]
    if not chosen:
        raise UserError(f"{what}: no checkpoint in that span; this run has updates "
                        f"{', '.join(str(n) for n in numbers)}")
    return chosen


def update_span(paths: list[Path]) -> dict[str, int]:
    """``first_update``, ``last_update`` and ``span_updates`` (last - first) of step
    checkpoints, from their names (``step-N``) or, for other names, their ``meta.json``'s
    ``step``; {} when a checkpoint has neither."""
    numbers = []
    for p in paths:
        n = step_number(p)
        if n is None:
            n = read_meta(p).get("step")
        if not isinstance(n, int):
            return {}
        numbers.append(n)
    if not numbers:
        return {}
    return {"first_update": min(numbers), "last_update": max(numbers),
            "span_updates": max(numbers) - min(numbers)}


def average_checkpoints(paths: list[Path], output: str | Path) -> Path:
    """Write the element-wise mean (accumulated in float64) of the weights in ``paths``.

    The config and vocabulary come from the newest checkpoint; all must share them. The
    average's ``meta.json`` records ``averaged_from`` and the updates it spans
    (:func:`update_span`: ``first_update``, ``last_update``, ``span_updates``).

    ``output`` must be a new path or an earlier average (a checkpoint whose ``meta.json`` has
    ``averaged_from``): nothing else is ever replaced.

    Raises:
        UserError: no paths, an ``output`` that exists and is not an earlier average (or is
            named like a step checkpoint), an unreadable checkpoint, checkpoints whose tensors
            differ in names or shapes, or whose vocabularies differ.
    """
    if not paths:
        raise UserError("no checkpoints to average")
    check_average_output(output)
    fingerprints = {Path(p): read_meta(p).get("vocab_fingerprint") for p in paths}
    if len({f for f in fingerprints.values() if f is not None}) > 1:
        listing = ", ".join(f"{p} ({f[:12] if f else 'none recorded'})"
                            for p, f in fingerprints.items())
        raise UserError(f"the checkpoints were trained with different vocabularies: {listing}; "
                        "average checkpoints of one run only")
    total: dict[str, torch.Tensor] = {}
    for path in paths:
        file = Path(path) / WEIGHTS
        try:
            weights = load_file(str(file))
        except Exception as err:  # safetensors' own error type: truncated or corrupt file
            raise UserError(f"{file}: not a readable safetensors file ({err})") from None
        if total and set(weights) != set(total):
            raise UserError(f"{path}: its tensors differ from {paths[0]}'s; average checkpoints "
                            "of one run only")
        for name, tensor in weights.items():
            if name in total and total[name].shape != tensor.shape:
                raise UserError(f"{path}: {name} has shape {tuple(tensor.shape)}, not "
                                f"{tuple(total[name].shape)}")
            total[name] = total.get(name, 0) + tensor.double()
    model, config, vocab = load_checkpoint(paths[-1])
    averaged = {name: (t / len(paths)).to(torch.float32) for name, t in total.items()}
    state = model.state_dict()
    for name in state:
        if name in averaged:
            state[name] = averaged[name]
    model.load_state_dict(state, strict=False)
    if config.model.share_embeddings:  # the tied matrix may be stored under either name
        src = averaged.get("src_embed.weight", averaged.get("tgt_embed.weight"))
        model.src_embed.weight.data.copy_(src)
    meta = {"averaged_from": [str(p) for p in paths], **update_span(paths)}
    return save_checkpoint(output, model, config, vocab, meta)


def check_average_output(output: str | Path) -> None:
    """Refuse an output path that averaging would destroy: anything that exists and is not an
    earlier average, and any ``step-N`` name inside a run's ``checkpoints/`` folder.

    Raises:
        UserError: naming ``output`` and what is there.
    """
    output = Path(output)
    if output.parent.name == CHECKPOINTS and step_number(output) is not None:
        raise UserError(f"-o {output}: names a step checkpoint of a run; write the average "
                        "elsewhere (default: RUN_DIR/averaged)")
    if not output.exists() and not output.is_symlink():
        return
    what = "a file" if not output.is_dir() else "a folder that is not an earlier average"
    if output.is_dir() and (output / META).is_file():
        try:
            if "averaged_from" in read_meta(output):
                return
        except UserError:
            pass
    raise UserError(f"-o {output}: already exists and is {what}; aiayn average replaces only "
                    "its own earlier output. Choose a new path")
