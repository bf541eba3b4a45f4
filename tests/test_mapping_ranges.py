"""Mapping's slices: every rank's share of a dimension, together, is the whole dimension once."""

from __future__ import annotations

import pytest

from trtmoe.parallel.mapping import Mapping


@pytest.mark.parametrize("tp, moe_tp, moe_ep", [(1, 1, 1), (2, 2, 1), (2, 1, 2), (4, 2, 2), (8, 4, 2)])
def test_rank_slices_partition_each_dimension(tp, moe_tp, moe_ep):
    mp = Mapping.create(tp=tp, moe_tp=moe_tp, moe_ep=moe_ep)
    heads, ffn, vocab = 32, 4 * 96, 250
    rows = [i for r in range(tp) for i in mp.tp_range(heads, r)]
    assert rows == list(range(heads)) and all(len(mp.tp_range(heads, r)) == mp.heads_per_rank(heads)
                                              for r in range(tp))
    cols = [i for t in range(moe_tp) for i in mp.moe_tp_range(ffn, t)]
    assert cols == list(range(ffn)) and len(mp.moe_tp_range(ffn, 0)) == mp.expert_ffn_per_rank(ffn)
    vrows = [i for r in range(tp) for i in mp.vocab_range(vocab, r)]
    assert vrows == list(range(mp.padded_vocab(vocab))) and mp.padded_vocab(vocab) % tp == 0
    assert mp.padded_vocab(vocab) - vocab < tp
