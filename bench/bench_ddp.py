"""What DDP's buffer broadcast costs an update, on gloo: the same updates of
:class:`aiayn.training.update.Learner` with the model wrapped as before (buffers broadcast from
rank 0 before every forward) and as :func:`aiayn.training.distributed.data_parallel` wraps it
now (the Transformer's buffers are constant: nothing sent).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 bench/bench_ddp.py \
        [--preset tiny] [--rounds 8] [--steps 5] [--max-tokens 1024]

Each round times ``--steps`` updates of each wrapper, in alternating order, on the same random
batches (after one untimed round), so that a shared host's load falls on both alike; the
figure is the median over rounds of each wrapper's milliseconds an update, and their ratio.
Also printed: the bytes of buffers the old wrapper sent before every forward (a count, not a
timing) for the preset and for ``base``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from aiayn.config import load_config
from aiayn.data.batching import EncodedCorpus, collate
from aiayn.model import Transformer
from aiayn.training.distributed import DistInfo, data_parallel, init_distributed
from aiayn.training.update import Learner, build_model, build_optimizer, training_precision


def buffer_bytes(model: torch.nn.Module) -> int:
    """The bytes of ``model``'s buffers (what a broadcast before every forward sends)."""
    return sum(b.numel() * b.element_size() for b in model.buffers())


def random_batches(config, count: int, max_tokens: int, seed: int) -> list:
    """``count`` batches of random pairs of 10-30 tokens, each about ``max_tokens`` a side."""
    g = torch.Generator().manual_seed(seed)
    vocab, batches = config.model.vocab_size, []
    for _ in range(count):
        length = int(torch.randint(10, 31, (1,), generator=g))
        rows = max(1, max_tokens // (length + 1))
        src = [torch.randint(4, vocab, (length,), generator=g).tolist() + [2]
               for _ in range(rows)]
        tgt = [torch.randint(4, vocab, (length,), generator=g).tolist() for _ in range(rows)]
        corpus = EncodedCorpus(src, tgt, list(range(rows)))
        batches.append(collate(corpus, list(range(rows)), start_id=config.model.decoder_start_id))
    return batches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=1024)
    args = p.parse_args()
    device = torch.device("cpu")
    info = init_distributed(device, "gloo")
    config = load_config(args.preset, ["train.precision=fp32"])
    model = build_model(config, device, config.train.seed)
    precision = training_precision("fp32", device, config.model, info)
    learner = Learner(config, model, build_optimizer(model, config.train), precision, device,
                      info, pad_id=0)
    # one wrapper at a time: two reducers on one module would both hook its gradients
    wrappers = {
        "broadcast": lambda: DistributedDataParallel(learner.compute_model,
                                                     broadcast_buffers=True),
        "aiayn": lambda: data_parallel(learner.compute_model, device, config.train),
    }
    batches = random_batches(config, args.steps, args.max_tokens, seed=info.rank)
    times: dict[str, list[float]] = {name: [] for name in wrappers}
    for r in range(args.rounds + 1):
        order = list(wrappers) if r % 2 == 0 else list(reversed(wrappers))
        for name in order:
            learner.ddp_model = wrappers[name]()
            dist.barrier()
            start = time.perf_counter()
            for batch in batches:
                learner.update([batch])
            if r:  # the first round builds the kernels
                times[name].append((time.perf_counter() - start) / len(batches) * 1000)
            learner.release_process_group()  # drops the wrapper and its reducer
    if DistInfo.from_env().is_main:
        ms = {name: statistics.median(t) for name, t in times.items()}
        base = Transformer(load_config("base").model)
        print(json.dumps({
            "preset": args.preset, "processes": info.world_size, "backend": "gloo",
            "ms_per_update": {k: round(v, 2) for k, v in ms.items()},
            "broadcast_over_aiayn": round(ms["broadcast"] / ms["aiayn"], 3),
            "buffer_bytes_per_forward_before": {args.preset: buffer_bytes(model),
                                                "base": buffer_bytes(base)},
            "buffer_bytes_per_forward_now": 0,
        }, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
