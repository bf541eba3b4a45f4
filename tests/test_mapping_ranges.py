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


@pytest.mark.parametrize("tp, moe_tp, moe_ep", [(1, 1, 1), (2, 1, 2), (4, 2, 2), (8, 1, 8), (8, 4, 2)])
def test_expert_slots_partition_the_experts_in_ep_rank_order(tp, moe_tp, moe_ep):
    mp = Mapping.create(tp=tp, pp=2, moe_tp=moe_tp, moe_ep=moe_ep)
    E = 16
    slots = [s for r in range(moe_ep) for s in mp.ep_slot_range(E, r)]
    assert slots == list(range(E)) and all(len(mp.ep_slot_range(E, r)) == mp.experts_per_rank(E)
                                           for r in range(moe_ep))
    for rank in mp.ranks():  # a global rank holds its EP rank's block, whatever its TP / PP position
        assert mp.ep_experts(E, rank) == mp.ep_slot_range(E, mp.moe_ep_rank(rank))
    perm = list(reversed(range(E)))
    groups = mp.ep_groups(perm)
    assert [e for g in groups for e in g] == perm and len(groups) == moe_ep
    assert all(g == [perm[s] for s in mp.ep_slot_range(E, r)] for r, g in enumerate(groups))


def test_ep_groups_refuses_experts_that_do_not_divide():
    from trtmoe.errors import LayoutError

    with pytest.raises(LayoutError, match="7 experts do not divide over moe_ep=2"):
        Mapping.create(tp=2, moe_ep=2).ep_groups(list(range(7)))


def test_balanced_placement_fills_each_ep_block_and_lowers_the_busiest_rank():
    from trtmoe.quant.policies import balanced_permutation, rank_loads

    mp = Mapping.create(tp=4, moe_tp=1, moe_ep=4)
    load = [40.0, 30.0, 20.0, 10.0, 1.0, 1.0, 1.0, 1.0]
    perm = balanced_permutation(load, mp)
    assert sorted(perm) == list(range(8))
    before, after = rank_loads(load, list(range(8)), mp), rank_loads(load, perm, mp)
    assert before == [70.0, 30.0, 2.0, 2.0] and sum(after) == sum(before)
    assert max(after) == 41.0  # the hottest expert and one cold one: the least a rank of two can hold
