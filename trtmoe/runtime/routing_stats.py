"""Routing statistics of an engine since load (or the last reset): top-k assignment counts, router
entropy and weight mass per layer and expert, tokens routed, and the decode steps' traffic (steps,
rows, the experts each step read, KV-cache bytes read).

Kept on the engine's device (no host sync per forward); small blocks' records are queued and added in
batches (``PENDING_ELEMS`` / ``PENDING_BLOCKS``); the lock guards the queue and totals against a
reader in another thread (a served model's metrics thread).
"""

from __future__ import annotations

import threading

import torch


class RoutingStats:
    def __init__(self, num_layers: int, num_experts: int, device: torch.device, kv_token_bytes: int):
        L, E = num_layers, num_experts
        self.num_experts, self.device, self.kv_token_bytes = E, device, kv_token_bytes
        self.counts = torch.zeros(L, E, dtype=torch.int64, device=device)
        self.entropy = torch.zeros(L, dtype=torch.float64, device=device)
        self.mass = torch.zeros(L, E, dtype=torch.float64, device=device)
        self.tokens = 0
        # Decode steps' traffic: steps, rows, the steps in which each expert was read [L, E], and the
        # KV-cache bytes read; the weights' bytes follow from these.
        self.dec_steps = self.dec_rows = self.dec_kv_bytes = 0
        self.dec_touched = torch.zeros(L, E, dtype=torch.int64, device=device)
        self.pending: list[list[tuple]] = []
        self.pending_decode: list[bool] = []
        self.pending_elems = 0
        self.lock = threading.Lock()
        self._layer_ids: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    # Deferred records are added once they hold this many router values or come from this many blocks
    # (or when the statistics are read or reset): a decode step then adds no tensor ops of its own for
    # them, and a reader (the served model's metrics thread, every 0.5 s) finds at most about 1 ms of
    # them to add while it holds the lock and the GIL that the decode thread needs. On the trained
    # fixture adding costs about 12 µs per block plus 0.035 µs per value however they are grouped;
    # bounded by values alone (65,536), 400 one-token steps waited for the reader and took it 5 ms,
    # a gap in every stream every 0.5 s.
    PENDING_ELEMS = 1 << 14
    PENDING_BLOCKS = 64

    def record(self, recs: list[tuple], tokens: int = 0, decode: int | None = None) -> None:
        """Add routing statistics (layer, expert counts, router probabilities, flat top-k ids,
        top-k weights) of one or more layers; they stay on the engine's device (no host sync).

        A single record (a big block's layer) is added at once. A list of every layer's records of a
        small block (layer, counts, router logits or probabilities, top-k ids, weights, whether the
        third item is logits) is queued, with the block's ``tokens``, and added later together with
        the following blocks': each total receives the same values in the same order as adding the
        blocks one by one would. ``decode``: the block is a decode step whose rows' caches held that
        many tokens in all (the experts it reads are counted, see ``EmbeddedEngine.decode_traffic``)."""
        with torch.no_grad():
            if len(recs) == 1 and recs[0][1] is not None and len(recs[0]) == 5:
                li, n_e, probs, flat_idx, w = recs[0]
                with self.lock:
                    self.flush()
                    self.counts[li].add_(n_e)
                    ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
                    self.entropy[li].add_(ent.sum())
                    self.mass[li].index_add_(0, flat_idx, w.reshape(-1).double())
                return
            if any(r[2].requires_grad for r in recs):  # keep no autograd graph alive in the queue
                recs = [r[:2] + (r[2].detach(),) + r[3:4] + (r[4].detach(),) + r[5:] for r in recs]
            with self.lock:
                self.tokens += tokens
                if decode is not None:
                    self.dec_steps += 1
                    self.dec_rows += tokens
                    self.dec_kv_bytes += decode * self.kv_token_bytes
                self.pending.append(recs)
                self.pending_decode.append(decode is not None)
                self.pending_elems += len(recs) * recs[0][2].numel()
                if self.pending_elems >= self.PENDING_ELEMS or len(self.pending) >= self.PENDING_BLOCKS:
                    self.flush()

    def flush(self) -> None:
        """Add the queued small blocks' records to the totals (the caller holds ``lock``).
        Consecutive blocks of the same layers, row count and kind go together: per (block, layer)
        the entropy is summed over the block's tokens in float32 as before, and the float64 totals
        receive those sums and the weights in block order."""
        pending, decode = self.pending, self.pending_decode
        if not pending:
            return
        self.pending, self.pending_decode, self.pending_elems = [], [], 0
        run: list[list[tuple]] = []
        flags: list[bool] = []
        for recs, dec in zip(pending, decode):
            if run and (len(recs) != len(run[0]) or any(
                    (a[0], a[2].shape, a[3].shape, a[5]) != (b[0], b[2].shape, b[3].shape, b[5])
                    for a, b in zip(recs, run[0]))):
                self._add_run(run, flags)
                run, flags = [], []
            run.append(recs)
            flags.append(dec)
        self._add_run(run, flags)

    def _add_run(self, run: list[list[tuple]], decode: list[bool] | None = None) -> None:
        key = tuple(r[0] for r in run[0])
        at = self._layer_ids.get(key)
        if at is None:  # the layers, and the offset of each one's experts in [L * E]
            ids = torch.tensor(key, device=self.device)
            at = self._layer_ids[key] = (ids, (ids * self.num_experts)[:, None])
        ids, off = at
        S, nl = len(run), len(key)
        p = torch.stack([r[2] for recs in run for r in recs])  # [blocks * layers, N, E]
        if run[0][0][5]:
            p = p.softmax(-1)
        ent = -(p * p.clamp_min(1e-30).log()).sum(-1)
        self.entropy.index_add_(0, ids.repeat(S), ent.sum(-1).double())
        flat = (torch.stack([r[3] for recs in run for r in recs]).view(S, nl, -1) + off).view(-1)
        self.counts.view(-1).add_(torch.bincount(flat, minlength=self.counts.numel()))
        self.mass.view(-1).index_add_(0, flat, torch.stack([r[4] for recs in run for r in recs]).view(-1).double())
        if decode and any(decode):
            # The experts each decode step read: a (step, layer, expert) presence count.
            LE = self.counts.numel()
            per_step = flat.view(S, -1) + torch.arange(S, device=flat.device)[:, None] * LE
            hits = torch.bincount(per_step.view(-1), minlength=S * LE).view(S, LE)
            if not all(decode):
                hits = hits[torch.tensor(decode, device=hits.device)]
            self.dec_touched.view(-1).add_((hits > 0).sum(0))

    def add_tokens(self, n: int) -> None:
        """Count ``n`` tokens routed by a forward whose records were added on their own."""
        with self.lock:
            self.tokens += n

    def snapshot(self, expert_bytes: torch.Tensor, nonexpert_bytes: tuple[int, int]) -> dict:
        """A consistent copy of every total, the decode traffic's included (see ``decode_totals``)."""
        with self.lock:
            self.flush()
            return {"counts": self.counts.to("cpu", copy=True), "entropy_sum": self.entropy.to("cpu", copy=True),
                    "tokens": self.tokens, "weight_mass": self.mass.to("cpu", copy=True),
                    "decode": self.decode_totals(expert_bytes, nonexpert_bytes)}

    def traffic(self, expert_bytes: torch.Tensor, nonexpert_bytes: tuple[int, int]) -> dict:
        with self.lock:
            self.flush()
            return self.decode_totals(expert_bytes, nonexpert_bytes)

    def decode_totals(self, expert_bytes: torch.Tensor, nonexpert_bytes: tuple[int, int]) -> dict:
        """The decode steps' traffic (the caller holds ``lock`` and flushed): ``expert_bytes`` [L, E]
        is what each expert's read costs, ``nonexpert_bytes`` (per step, per row) the rest."""
        touched = self.dec_touched.to("cpu", copy=True)
        return {"steps": self.dec_steps, "rows": self.dec_rows, "touched": touched,
                "distinct_sum": touched.sum(-1), "expert_bytes": int((touched * expert_bytes).sum()),
                "nonexpert_bytes": self.dec_steps * nonexpert_bytes[0] + self.dec_rows * nonexpert_bytes[1],
                "kv_bytes": self.dec_kv_bytes}

    def reset(self) -> None:
        with self.lock:
            self._drop_pending()
            self.dec_touched.zero_()
            self.dec_steps = self.dec_rows = self.dec_kv_bytes = 0
            self.counts.zero_()
            self.entropy.zero_()
            self.mass.zero_()
            self.tokens = 0

    def _drop_pending(self) -> None:
        self.pending.clear()
        self.pending_decode.clear()
        self.pending_elems = 0

    def save(self) -> tuple:
        """The routing totals now (queue flushed), for ``restore``: work that must not count (a
        recomputed history) runs between the two."""
        with self.lock:
            self.flush()
            return self.counts.clone(), self.entropy.clone(), self.mass.clone(), self.tokens

    def restore(self, saved: tuple) -> None:
        """Put the routing totals back as ``save`` found them (what was queued since is dropped)."""
        with self.lock:
            self._drop_pending()
            self.counts.copy_(saved[0])
            self.entropy.copy_(saved[1])
            self.mass.copy_(saved[2])
            self.tokens = saved[3]


def decode_summary(after: dict, before: dict | None = None, moe_layers: list[int] | None = None) -> dict:
    """Per-step figures of the decode steps between two ``decode_traffic`` snapshots (``before`` None:
    since load): steps, tokens, mean distinct experts read per MoE layer, and bytes read per step."""
    d = {k: after[k] - before[k] for k in ("steps", "rows", "distinct_sum", "expert_bytes", "nonexpert_bytes",
                                           "kv_bytes")} if before is not None else dict(after)
    n = d["steps"]
    layers = moe_layers if moe_layers is not None else list(range(len(d["distinct_sum"])))
    per_layer = {str(l): (float(d["distinct_sum"][l]) / n if n else 0.0) for l in layers}
    per_step = {k: (d[k] / n if n else 0.0) for k in ("expert_bytes", "nonexpert_bytes", "kv_bytes")}
    return {"steps": n, "tokens": d["rows"], "mean_batch": d["rows"] / n if n else 0.0,
            "distinct_experts_per_layer": per_layer,
            "distinct_experts_mean": sum(per_layer.values()) / len(per_layer) if per_layer else 0.0,
            "bytes_per_step": {**per_step, "total": sum(per_step.values())}}
