"""The embedded engine's routing statistics: decode steps queue their records and add them later in
batches, so what ``routing_stats`` returns must still be every routed token's counts, router entropy
and weight mass, whether it is read between steps, from another thread while the engine runs, or
after a reset."""

from __future__ import annotations

import threading

import pytest
import torch

from trtmoe.checkpoint.writer import convert
from trtmoe.runtime.engine import EmbeddedEngine, SamplingParams

E, L, K = 8, 2, 2


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    model = tiny_model("mixtral", num_local_experts=E, num_hidden_layers=L, seed=5, hidden_size=64,
                       intermediate_size=64, head_dim=16, dtype="float32")
    return EmbeddedEngine.from_checkpoint(convert(model, tmp_path_factory.mktemp("stats") / "ck").out_dir,
                                          device="cpu")


def _observed(eng: EmbeddedEngine):
    """Expected statistics, recomputed from the router inputs and picks the hooks see."""
    c = eng.cfg
    exp = {"counts": torch.zeros(L, E, dtype=torch.int64), "entropy_sum": torch.zeros(L, dtype=torch.float64),
           "weight_mass": torch.zeros(L, E, dtype=torch.float64), "tokens": 0}

    def layer_hook(li, h):
        p = eng.layers[li].router(h.float()).softmax(-1).double()
        exp["entropy_sum"][li] += float(-(p * p.clamp_min(1e-30).log()).sum())
        top, idx = p.topk(c.top_k, dim=-1)  # RENORMALIZE: the softmax of the top-k logits
        w = top / top.sum(-1, keepdim=True)
        exp["counts"][li] += torch.bincount(idx.reshape(-1), minlength=E)
        exp["weight_mass"][li].index_add_(0, idx.reshape(-1), w.reshape(-1))
        if li == 0:
            exp["tokens"] += h.shape[0]

    eng.layer_hook = layer_hook
    return exp


def _check(stats, exp):
    assert torch.equal(stats["counts"], exp["counts"])
    assert stats["tokens"] == exp["tokens"]
    assert torch.allclose(stats["entropy_sum"], exp["entropy_sum"], rtol=1e-5)
    assert torch.allclose(stats["weight_mass"], exp["weight_mass"], rtol=1e-5)


def test_decode_statistics_are_every_token_routed(engine):
    eng = engine
    eng.reset_routing_stats()
    exp = _observed(eng)
    try:
        g = torch.Generator().manual_seed(0)
        for B in (1, 5):  # one-token blocks, then small grouped blocks
            prompts = torch.randint(4, eng.vocab_size, (B, 7), generator=g).tolist()
            seqs = eng.start_many(prompts, [SamplingParams(max_new_tokens=30) for _ in prompts])
            for i in range(29):
                eng.step(seqs)
                if i == 10:  # a read between steps sees the steps so far, and changes nothing
                    _check(eng.routing_stats(), exp)
        stats = eng.routing_stats()
        assert stats["counts"].sum() == K * L * exp["tokens"]
        _check(stats, exp)
        # A reset drops queued records too.
        s = eng.start([5, 6, 7], SamplingParams(max_new_tokens=4))
        eng.step([s])
        eng.reset_routing_stats()
        assert int(eng.routing_stats()["counts"].sum()) == 0 and eng.routing_stats()["tokens"] == 0
    finally:
        eng.layer_hook = None


def test_queued_records_stay_bounded_and_complete(engine):
    """Long decodes queue at most a bounded amount for a reader to add (so a metrics read never holds
    the decode thread up for long): by block count for one-token steps, by values for wide batches;
    the totals still count every routed token."""
    eng = engine
    eng.reset_routing_stats()
    exp = _observed(eng)
    try:
        g = torch.Generator().manual_seed(2)
        peak = {}
        for B in (1, 32):  # 16 router values per token: the block bound first, then the values bound
            eng.routing_stats()  # a read adds what is queued (and changes no total)
            prompts = torch.randint(4, eng.vocab_size, (B, 3), generator=g).tolist()
            seqs = eng.start_many(prompts, [SamplingParams(max_new_tokens=150) for _ in prompts])
            most = (0, 0)
            for _ in range(149):
                eng.step(seqs)
                most = (max(most[0], len(eng._routing.pending)), max(most[1], eng._routing.pending_elems))
            peak[B] = most
        assert peak[1][0] == eng._routing.PENDING_BLOCKS - 1  # 149 one-token steps: flushed at 64 blocks
        per_block = L * 32 * E  # router logits of a 32-token step
        assert peak[32] == (eng._routing.PENDING_ELEMS // per_block - 1, eng._routing.PENDING_ELEMS - per_block)
        _check(eng.routing_stats(), exp)
    finally:
        eng.layer_hook = None


def test_reads_from_another_thread_are_consistent_snapshots(engine):
    """A metrics thread reads while the engine decodes: every snapshot's counts are exactly top_k
    per routed token and layer (never a step half added), and the final totals are complete."""
    eng = engine
    eng.reset_routing_stats()
    exp = _observed(eng)
    bad, reads, stop = [], [0], threading.Event()

    def reader():
        while not stop.is_set():
            st = eng.routing_stats()
            reads[0] += 1
            if not torch.equal(st["counts"].sum(-1), torch.full((L,), K * st["tokens"])):
                bad.append((st["counts"].sum(-1).tolist(), st["tokens"]))

    t = threading.Thread(target=reader)
    t.start()
    try:
        g = torch.Generator().manual_seed(1)
        for B in (1, 3, 8):
            prompts = torch.randint(4, eng.vocab_size, (B, 5), generator=g).tolist()
            seqs = eng.start_many(prompts, [SamplingParams(max_new_tokens=40) for _ in prompts])
            for _ in range(39):
                eng.step(seqs)
    finally:
        stop.set()
        t.join()
        eng.layer_hook = None
    assert reads[0] > 0 and not bad, bad[:3]
    _check(eng.routing_stats(), exp)
