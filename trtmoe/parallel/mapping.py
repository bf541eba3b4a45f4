"""All rank arithmetic, exactly as TensorRT-LLM's ``Mapping`` defines it. Nothing else computes a rank.

rank = pp_rank * tp + tp_rank (cp = 1); moe_ep_rank = tp_rank % moe_ep (EP varies fastest inside
a TP group); moe_tp_rank = tp_rank // moe_ep; each EP rank holds a contiguous block of experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, TypeVar

from ..errors import LayoutError
from ..model.description import ModelSpec

T = TypeVar("T")


@dataclass(frozen=True)
class Mapping:
    tp_size: int = 1
    pp_size: int = 1
    moe_tp_size: int = 1
    moe_ep_size: int = 1
    gpus_per_node: int = 8

    @classmethod
    def create(cls, tp: int = 1, pp: int = 1, moe_tp: int | None = None, moe_ep: int | None = None,
               gpus_per_node: int = 8) -> "Mapping":
        """Derive the missing MoE size like TensorRT-LLM: neither given -> moe_tp = tp."""
        for n, v in (("tp", tp), ("pp", pp), ("moe_tp", moe_tp), ("moe_ep", moe_ep)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise LayoutError(f"{n} must be a positive integer, got {v!r}")
        if moe_tp is None and moe_ep is None:
            moe_tp, moe_ep = tp, 1
        elif moe_tp is None:
            if tp % moe_ep:
                raise LayoutError(f"moe_ep={moe_ep} does not divide tp={tp} (moe_ep that do: {_listed(_divisors(tp))})")
            moe_tp = tp // moe_ep
        elif moe_ep is None:
            if tp % moe_tp:
                raise LayoutError(f"moe_tp={moe_tp} does not divide tp={tp} (moe_tp that do: {_listed(_divisors(tp))})")
            moe_ep = tp // moe_tp
        if moe_tp * moe_ep != tp:
            raise LayoutError(f"moe_tp × moe_ep must equal tp: {moe_tp} × {moe_ep} = {moe_tp * moe_ep} ≠ {tp}")
        return cls(tp, pp, moe_tp, moe_ep, gpus_per_node)

    @classmethod
    def from_config(cls, d: dict) -> "Mapping":
        m = cls.create(d.get("tp_size", 1), d.get("pp_size", 1), d.get("moe_tp_size"), d.get("moe_ep_size"),
                       d.get("gpus_per_node", 8))
        if d.get("world_size", m.world_size) != m.world_size:
            raise LayoutError(f"world_size={d['world_size']} but tp×pp = {m.world_size}")
        if d.get("cp_size", 1) != 1:
            raise LayoutError("cp_size > 1 is not supported for MoE models")
        return m

    def to_dict(self) -> dict:
        """The ``mapping`` block of a TensorRT-LLM checkpoint config (``from_config`` reads it back)."""
        return {"world_size": self.world_size, "gpus_per_node": self.gpus_per_node, "cp_size": 1,
                "tp_size": self.tp_size, "pp_size": self.pp_size, "moe_tp_size": self.moe_tp_size,
                "moe_ep_size": self.moe_ep_size}

    def summary(self) -> dict:
        """The short form trtmoe's manifests record (tp, pp, moe_tp, moe_ep, world_size)."""
        return {"tp": self.tp_size, "pp": self.pp_size, "moe_tp": self.moe_tp_size, "moe_ep": self.moe_ep_size,
                "world_size": self.world_size}

    # ---- sizes and ranks ---------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def rank(self, tp_rank: int, pp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp_size

    def pp_rank(self, rank: int) -> int:
        return rank // self.tp_size

    def moe_ep_rank(self, rank: int) -> int:
        return self.tp_rank(rank) % self.moe_ep_size

    def moe_tp_rank(self, rank: int) -> int:
        return self.tp_rank(rank) // self.moe_ep_size

    def tp_rank_for(self, moe_tp_rank: int, moe_ep_rank: int) -> int:
        return moe_tp_rank * self.moe_ep_size + moe_ep_rank

    def ranks(self) -> range:
        return range(self.world_size)

    # ---- what a rank holds ---------------------------------------------------------------------
    def pp_layers(self, num_layers: int, pp_rank: int) -> list[int]:
        """Global layer indices on a PP rank: the first ``L % pp`` ranks get one extra layer."""
        base, extra = divmod(num_layers, self.pp_size)
        start = pp_rank * base + min(pp_rank, extra)
        return list(range(start, start + base + (1 if pp_rank < extra else 0)))

    def layer_owner(self, num_layers: int, layer: int) -> tuple[int, int]:
        """(pp_rank, local index) of a global layer."""
        for p in range(self.pp_size):
            layers = self.pp_layers(num_layers, p)
            if layer in layers:
                return p, layer - layers[0]
        raise IndexError(layer)

    def experts_per_rank(self, num_experts: int) -> int:
        """Routed experts each expert-parallel rank holds."""
        return num_experts // self.moe_ep_size

    def expert_ffn_per_rank(self, intermediate_size: int) -> int:
        """An expert's FFN width on each MoE tensor-parallel rank."""
        return intermediate_size // self.moe_tp_size

    def heads_per_rank(self, num_heads: int) -> int:
        """Query heads per tensor-parallel rank."""
        return num_heads // self.tp_size

    def tp_shard(self, size: int) -> int:
        """One tensor-parallel rank's share of a dimension of ``size`` split evenly over tp."""
        return size // self.tp_size

    def tp_range(self, size: int, tp_rank: int) -> range:
        """The indices of a dimension of ``size`` that tensor-parallel rank ``tp_rank`` holds."""
        per = self.tp_shard(size)
        return range(tp_rank * per, (tp_rank + 1) * per)

    def moe_tp_range(self, intermediate_size: int, moe_tp_rank: int) -> range:
        """The rows (fc) or columns (proj) of an expert's FFN that MoE tensor-parallel rank holds."""
        per = self.expert_ffn_per_rank(intermediate_size)
        return range(moe_tp_rank * per, (moe_tp_rank + 1) * per)

    def vocab_range(self, vocab_size: int, tp_rank: int) -> range:
        """The rows of the vocabulary, zero-padded to a multiple of tp, that ``tp_rank`` holds (may
        reach past ``vocab_size``: those rows are the padding)."""
        return self.tp_range(self.padded_vocab(vocab_size), tp_rank)

    def ep_slot_range(self, num_experts: int, moe_ep_rank: int) -> range:
        """The expert slots expert-parallel rank ``moe_ep_rank`` holds: a contiguous block of
        ``experts_per_rank`` slots (a plan's placement says which original expert sits in a slot)."""
        per = self.experts_per_rank(num_experts)
        return range(moe_ep_rank * per, (moe_ep_rank + 1) * per)

    def ep_experts(self, num_experts: int, rank: int) -> range:
        """The expert slots global rank ``rank`` holds."""
        return self.ep_slot_range(num_experts, self.moe_ep_rank(rank))

    def ep_groups(self, per_slot: Sequence[T]) -> list[list[T]]:
        """``per_slot`` (one item per expert slot, e.g. a placement or per-expert loads) cut into the
        blocks each expert-parallel rank holds, in EP-rank order."""
        if len(per_slot) % self.moe_ep_size:
            raise LayoutError(f"{len(per_slot)} experts do not divide over moe_ep={self.moe_ep_size}")
        return [list(per_slot[s] for s in self.ep_slot_range(len(per_slot), r)) for r in range(self.moe_ep_size)]

    def is_first_pp_rank(self, rank: int) -> bool:
        return self.pp_rank(rank) == 0

    def is_last_pp_rank(self, rank: int) -> bool:
        return self.pp_rank(rank) == self.pp_size - 1

    def kv_heads_per_rank(self, num_kv_heads: int) -> int:
        """KV heads per TP rank after TensorRT-LLM's duplication when num_kv_heads < tp."""
        return max(1, num_kv_heads // self.tp_size)

    def kv_head_range(self, num_kv_heads: int, tp_rank: int) -> range:
        if num_kv_heads >= self.tp_size:
            per = num_kv_heads // self.tp_size
            return range(tp_rank * per, (tp_rank + 1) * per)
        dup = self.tp_size // num_kv_heads
        h = tp_rank // dup
        return range(h, h + 1)

    def padded_vocab(self, vocab_size: int) -> int:
        return -(-vocab_size // self.tp_size) * self.tp_size

    # ---- checks ----------------------------------------------------------------------------------
    def validate(self, m: ModelSpec) -> None:
        """Raise LayoutError, with the numbers and the values that would work, if this layout cannot
        hold the model."""
        problems = []
        tp, I = self.tp_size, m.expert_intermediate_size
        fit_tp = ""  # the values that work are named once, after the problems they answer
        if m.num_heads % tp:
            problems.append(f"num_attention_heads={m.num_heads} is not divisible by tp={tp}{fit_tp}")
        kv = m.num_kv_heads
        if kv >= tp and kv % tp:
            problems.append(f"num_key_value_heads={kv} is not divisible by tp={tp}{fit_tp}")
        if kv < tp and tp % kv:
            problems.append(f"tp={tp} is not a multiple of num_key_value_heads={kv} "
                            f"(needed to duplicate KV heads){fit_tp}")
        # moe_tp × moe_ep = tp: the splits of this tp that hold the experts and their FFN
        splits = [(t, tp // t) for t in _divisors(tp) if I % t == 0 and m.num_experts % (tp // t) == 0]
        fit_split = ""
        if m.num_experts % self.moe_ep_size:
            ok_ep = [e for e in _divisors(m.num_experts) if e <= 64]
            problems.append(f"num_experts={m.num_experts} is not divisible by moe_ep={self.moe_ep_size} "
                            f"(moe_ep that divide it: {_listed(ok_ep)}){fit_split}")
        if I % self.moe_tp_size:
            problems.append(f"expert intermediate size {I} is not divisible by moe_tp={self.moe_tp_size}{fit_split}")
        if m.shared_expert_intermediate_size % tp:
            problems.append(f"shared expert intermediate size {m.shared_expert_intermediate_size} is not "
                            f"divisible by tp={tp}{fit_tp}")
        if not all(m.moe_layers) and m.dense_intermediate_size % tp:
            problems.append(f"dense intermediate size {m.dense_intermediate_size} is not divisible by "
                            f"tp={tp}{fit_tp}")
        if self.pp_size > m.num_layers:
            problems.append(f"pp={self.pp_size} exceeds num_hidden_layers={m.num_layers}")
        if any("tp=" in p and "moe_tp=" not in p for p in problems):
            problems.append("tp that fit this model: " + _listed(valid_tp(m)))
        if m.num_experts % self.moe_ep_size or I % self.moe_tp_size:
            problems.append(f"splits of tp={tp} that fit the experts: "
                            + (", ".join(f"moe_tp={t} moe_ep={e}" for t, e in splits) if splits else "none"))
        if problems:
            raise LayoutError("impossible layout: " + "; ".join(problems),
                              hint=f"tp={self.tp_size} pp={self.pp_size} moe_tp={self.moe_tp_size} "
                                   f"moe_ep={self.moe_ep_size}")

    def describe(self) -> str:
        return (f"tp={self.tp_size} pp={self.pp_size} moe_tp={self.moe_tp_size} moe_ep={self.moe_ep_size} "
                f"(world size {self.world_size})")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else []


def _listed(values: list[int]) -> str:
    return ", ".join(map(str, values)) or "none"


def valid_tp(m: ModelSpec, most: int = 64) -> list[int]:
    """The tensor-parallel sizes up to ``most`` that the model's attention heads, KV heads, shared and
    dense FFNs divide into (what ``validate`` checks of tp alone; the expert split is apart)."""
    kv = m.num_kv_heads
    return [t for t in range(1, most + 1)
            if m.num_heads % t == 0 and (kv % t == 0 if kv >= t else t % kv == 0)
            and m.shared_expert_intermediate_size % t == 0
            and (all(m.moe_layers) or m.dense_intermediate_size % t == 0)]
