"""Property-based tests (hypothesis) of the token batcher, §5.1: for any lengths, token budget,
seed and shard count, every pair is in exactly one batch of one shard, no batch exceeds the
budget on either side (counted with padding), and every shard gets the same number of
batches (data-parallel processes must take the same number of steps)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from aiayn.data.batching import make_batches

lengths = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=120)


@settings(max_examples=150, deadline=None)
@given(pairs=lengths, max_tokens=st.integers(40, 400), seed=st.integers(0, 2**31 - 1),
       epoch=st.integers(0, 50), shards=st.integers(1, 4), shuffle=st.booleans())
@example(pairs=[(1, 1), (1, 1), (1, 14), (1, 21), (1, 21), (1, 21)], max_tokens=40, seed=0,
         epoch=0, shards=4, shuffle=False)  # 5 batches, one of two pairs: 6 < 8 cannot be dealt
def test_every_pair_once_within_bounds_equal_shards(pairs, max_tokens, seed, epoch, shards,
                                                     shuffle) -> None:
    src = np.array([s for s, _ in pairs])
    tgt = np.array([t for _, t in pairs])
    if len(pairs) < shards:
        with pytest.raises(ValueError, match="num_shards"):
            make_batches(src, tgt, max_tokens, num_shards=shards)
        return
    try:
        per_shard = [make_batches(src, tgt, max_tokens, seed=seed, epoch=epoch,
                                  shuffle=shuffle, num_shards=shards, shard_index=k)
                     for k in range(shards)]
    except ValueError as err:  # only when halving every batch down to single pairs still
        assert "cannot be dealt equally" in str(err)  # leaves no multiple of shards
        single = make_batches(src, tgt, max_tokens, seed=seed, epoch=epoch, shuffle=shuffle)
        assert len(pairs) < len(single) + (-len(single) % shards)
        return
    assert len({len(b) for b in per_shard}) == 1  # equal shards
    seen = sorted(i for batches in per_shard for batch in batches for i in batch)
    assert seen == list(range(len(pairs)))  # every pair exactly once
    for batches in per_shard:
        for batch in batches:
            assert batch, "no empty batch"
            assert len(batch) * max(src[i] for i in batch) <= max_tokens
            assert len(batch) * max(tgt[i] for i in batch) <= max_tokens
    again = make_batches(src, tgt, max_tokens, seed=seed, epoch=epoch, shuffle=shuffle,
                         num_shards=shards, shard_index=0)
    assert again == per_shard[0]  # a pure function of its arguments (exact resume)


@settings(max_examples=50, deadline=None)
@given(pairs=lengths, max_tokens=st.integers(1, 39))
def test_a_pair_that_cannot_fit_is_refused(pairs, max_tokens) -> None:
    src = np.array([s for s, _ in pairs])
    tgt = np.array([t for _, t in pairs])
    longest = int(max(src.max(), tgt.max()))
    if longest <= max_tokens:
        assert sum(len(b) for b in make_batches(src, tgt, max_tokens)) == len(pairs)
    else:
        with pytest.raises(ValueError, match=f"a pair of {longest} tokens"):
            make_batches(src, tgt, max_tokens)
