"""The pooled KV cache: one tensor per layer with a row per live sequence, the per-forward plan of
where a batch writes and reads it, and whole-row copies (a repeated prompt, beam reordering)."""

from __future__ import annotations

import heapq
import weakref
from collections import deque

import torch

from .sampling import Sequence


class KVPool:
    """Keys and values of every live sequence: per layer one ``[slots, nkv, capacity, hd]`` tensor
    (head-major: each head's history is contiguous, which is what attention reads; a decode step
    writes every sequence's new key with one ``index_copy_`` into the flat ``[slots * nkv *
    capacity]`` rows, one row per sequence and head).

    A sequence holds one slot from its prefill until it finishes (or is garbage-collected, e.g. when
    a cancelled request is dropped). A collected sequence's finalizer runs on whichever thread the
    collector ran in (a server's sender or metrics thread, say), so ``release`` only queues the slot;
    the engine's own thread applies the queue (``drain``) before it takes a slot or runs a step.
    Applied off-thread, an idle pool's clearing once emptied the cache lists under a running
    forward ("list index out of range"). Both dimensions grow on demand (existing rows are copied over),
    so the pool holds at most (active sequences, rounded up to a power of two) x (the longest
    prompt + max_new_tokens seen since the engine was last idle); it is freed when no sequence is
    live. The lowest free slot is reused first, so a steady batch keeps to a contiguous block of
    rows and its step reads the cache as a view instead of a gather.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.num_layers, self.nkv, self.hd = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.slots = 0
        self.capacity = 0
        self._free: list[int] = []
        self.live = 0
        self._released: deque[int] = deque()  # slots released from any thread, applied by drain()

    def _resize(self, slots: int, capacity: int) -> None:
        shape = (slots, self.nkv, capacity, self.hd)
        for kv in (self.k, self.v):
            old = list(kv)
            kv.clear()
            for l in range(self.num_layers):
                # Zeros, not empty: a step reads every row up to its longest sequence, and masked
                # attention weights (0) times uninitialized NaN/Inf bits would still be NaN.
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if old:
                    new[: self.slots, :, : self.capacity] = old[l]
                kv.append(new)
        for i in range(self.slots, slots):
            heapq.heappush(self._free, i)
        self.slots, self.capacity = slots, capacity

    def acquire(self, need: int) -> int:
        """A free slot able to hold ``need`` tokens (the engine's thread)."""
        self.drain()
        slots, cap = self.slots, self.capacity
        if need > cap:
            # Doubling amortizes growth, but never reserve more than 4x what was asked for.
            cap = max(need + (-need) % 64, min(2 * cap, 4 * need))
        if not self._free:
            slots = max(4, 2 * self.slots)
        if (slots, cap) != (self.slots, self.capacity):
            self._resize(slots, cap)
        self.live += 1
        return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        """Give ``slot`` back; any thread (see the class docstring). Takes effect at the next ``drain``."""
        self._released.append(slot)

    def drain(self) -> None:
        """Apply the queued releases (the engine's thread)."""
        released = False
        while self._released:
            heapq.heappush(self._free, self._released.popleft())
            self.live -= 1
            released = True
        if released and self.live == 0:  # idle: give the memory back rather than keep a burst's peak
            self.k.clear()
            self.v.clear()
            self._free.clear()
            self.slots = self.capacity = 0


def attach(pool: KVPool, s: Sequence, capacity: int) -> None:
    """Give ``s`` a row of ``pool`` able to hold ``capacity`` tokens. It is freed when the sequence
    finishes (``detach``), or when it is dropped unfinished (a cancelled request)."""
    slot = pool.acquire(capacity)
    s.slot = slot
    s.kv_capacity = pool.capacity
    s._release = weakref.finalize(s, pool.release, slot)


def detach(pool: KVPool, s: Sequence) -> None:
    """Free the row of ``s`` now (once: a second call does nothing)."""
    if s._release is not None:
        s._release()  # a finalize object runs once
        s._release = None
        s.slot = -1
        pool.drain()


def stats(pool: KVPool) -> dict[str, int | str]:
    """Rows allocated, rows held by live sequences, tokens per row, bytes allocated, device."""
    nbytes = sum(t.numel() * t.element_size() for t in (*list(pool.k), *list(pool.v)))
    return {"slots": pool.slots, "live": pool.live - len(pool._released), "capacity": pool.capacity,
            "bytes": nbytes, "device": str(pool.device)}


def cache_plan(pool: KVPool, seqs: list[Sequence], pos: torch.Tensor, T: int) -> dict:
    """What every layer's attention needs to write and read the pooled cache for this batch,
    computed once per forward: slots, write positions, the rows to read, and the mask."""
    dev = pos.device
    slots = [s.slot for s in seqs]
    starts = [s.length for s in seqs]
    lens = [a + T for a in starts]
    Lmax = max(lens)
    plan = {"Lmax": Lmax, "slot_t": None, "rows": None}
    # e.g. a batched prefill, or a decode step over sequences of one length
    plan["same_start"] = starts[0] if starts.count(starts[0]) == len(starts) else None
    first = slots[0]
    if slots != list(range(first, first + len(seqs))):  # rows are gathered, not viewed
        plan["slot_t"] = torch.tensor(slots, device=dev)
    else:
        plan["rows"] = slice(first, first + len(seqs))
    if T == 1:
        # Each sequence's new key of head h goes to row (slot * nkv + h) * capacity + length of
        # the flat pool.
        cap, nkv = pool.capacity, pool.nkv
        plan["write_at"] = torch.tensor([(sl * nkv + h) * cap + a for sl, a in zip(slots, starts)
                                         for h in range(nkv)], device=dev)
        # The one query of each sequence, at its last position, sees exactly its own keys: the
        # causal part of the mask is implied, and sequences of one length need no mask at all.
        plan["mask"] = None if plan["same_start"] is not None else (
            torch.arange(Lmax, device=dev) < torch.tensor(lens, device=dev)[:, None])[:, None, None, :]
        return plan
    key_pos = torch.arange(Lmax, device=dev)
    qpos = pos[:, None, :, None]  # [B, 1, T, 1]
    plan["mask"] = (key_pos[None, None, None, :] <= qpos) & (
        key_pos[None, None, None, :] < torch.tensor(lens, device=dev)[:, None, None, None])
    return plan


def copy_rows(pool: KVPool, dst: list[int], src: list[int]) -> None:
    """Copy whole cache rows ``src`` onto rows ``dst`` in every layer (sources read first)."""
    d = torch.tensor(dst, device=pool.device)
    sidx = torch.tensor(src, device=pool.device)
    for kv in (pool.k, pool.v):
        for t in kv:
            t.index_copy_(0, d, t.index_select(0, sidx))
