"""What a deployment moves per decode step: expert coverage, bytes read and the bandwidth roofline.

At batch B a decode step routes B tokens, one per stream. A MoE layer then reads the weights of every
expert at least one of them picked: the union of B top-k sets, which grows with B towards the whole
layer. With ``p_e`` the probability that a token's top-k set includes expert ``e`` (its share of the
calibration's tokens; the ``p_e`` of a layer sum to k) and the B streams' tokens independent of each
other, expert ``e`` is read with probability ``1 - (1 - p_e)^B`` and

    E[distinct experts per step] = Σ_e 1 - (1 - p_e)^B

exactly: each token picks k *distinct* experts (top-k, no replacement), which ``p_e`` already
accounts for, so no with-replacement shortcut (``E·(1 - (1 - 1/E)^{kB})``) is made. Uniform routing
is ``p_e = k / E``. A step reads every non-expert weight once (attention, norms, routers, shared
experts, dense MLPs, lm_head; B rows of the embedding), the experts it touches at their own formats'
sizes (packed bytes and scales) and each stream's KV cache.

Per rank, the bytes of the weights and cache that rank holds; a step's time under the roofline is,
per pipeline stage, the busiest rank's non-expert bytes plus, per MoE layer, the busiest rank's expert
bytes (the ranks of a stage synchronise at every layer), over the GPU's memory bandwidth; the stages
run one after the other (one batch in flight). Compute, communication and kernel efficiency are not
modelled: it is the upper bound memory bandwidth allows.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich import box
from rich.table import Table

from ..checkpoint.layout import DTYPE_STR, rank_specs
from ..console import fmt_bytes
from ..errors import InputError
from ..hf.reader import parse_dtype
from ..model.description import ModelSpec
from ..parallel.mapping import Mapping
from ..quant.plan import FLOAT
from ..quant.policies import balanced_permutation, matrix_cost_bits
from ..quant.calibrate import load_calib
from ..runtime.checkpoint_reader import load_config
from ..runtime.experts import slot_formats
from .inspect import _describe as describe_model

DEFAULT_BATCHES = (1, 8, 32, 128)
DEFAULT_CONTEXT = 2048
ASSUMPTIONS = (
    "the B streams' tokens are independent draws from the calibration's text: expert e is read with "
    "probability 1 - (1 - p_e)^B, p_e = its share of calibration tokens (top-k inclusion probability)",
    "every stream's KV cache holds the given context; weights and cache are read once per step",
    "roofline: bytes / memory bandwidth, compute and communication not modelled; pipeline stages run "
    "one after another (one batch in flight); the ranks of a stage wait for the busiest at every MoE layer "
    "(its expected expert bytes with experts read independently, an approximation where moe_ep > 1)",
)


@dataclass(frozen=True)
class GPU:
    name: str
    bandwidth: float  # bytes per second
    source: str


# Vendor datasheet figures (decimal terabytes per second of HBM bandwidth).
GPUS = {
    "H100": GPU("H100", 3.35e12, "NVIDIA H100 SXM5 datasheet: 3.35 TB/s (HBM3)"),
    "H200": GPU("H200", 4.8e12, "NVIDIA H200 SXM datasheet: 4.8 TB/s (HBM3e)"),
    "B200": GPU("B200", 8.0e12, "NVIDIA B200 (HGX B200) datasheet: 8 TB/s (HBM3e)"),
}


def parse_gpu(text: str | None) -> GPU:
    """A preset name (H100, H200, B200) or a bandwidth in GB/s ("2000", "2000GB/s", "3.35TB/s")."""
    if text is None:
        return GPUS["H100"]
    key = text.strip().upper()
    if key in GPUS:
        return GPUS[key]
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(GB/S|TB/S)?", key)
    if not m or float(m.group(1)) <= 0:
        raise InputError(f"--gpu {text!r} is neither a preset nor a bandwidth",
                         hint="use H100, H200, B200 or a bandwidth such as 2000 (GB/s) or 3.35TB/s")
    bw = float(m.group(1)) * (1e12 if m.group(2) == "TB/S" else 1e9)
    return GPU(f"{bw / 1e9:g} GB/s", bw, "given on the command line")


def parse_batches(text: str | list[int] | tuple[int, ...] | None) -> list[int]:
    """``"1,8,32"`` -> [1, 8, 32]; every batch a positive integer."""
    if text is None:
        return list(DEFAULT_BATCHES)
    items = text.split(",") if isinstance(text, str) else list(text)
    try:
        out = [int(str(x).strip()) for x in items if str(x).strip()]
    except ValueError:
        raise InputError(f"--batch {text!r}: give batch sizes as integers, e.g. 1,8,32,128") from None
    if not out or any(b < 1 for b in out):
        raise InputError(f"--batch {text!r}: batch sizes must be integers ≥ 1")
    return sorted(set(out))


# ---- routing probabilities ------------------------------------------------------------------------
def inclusion_probs(calib: dict, m: ModelSpec) -> dict[int, list[float]]:
    """Per MoE layer, each expert's probability of being in a token's top-k set: its calibration
    count over the tokens routed (sums to top_k)."""
    if calib["num_layers"] != m.num_layers or calib["num_experts"] != m.num_experts or calib["top_k"] != m.top_k:
        raise InputError("the calibration was measured on another model "
                         f"({calib['num_layers']} layers, {calib['num_experts']} experts, top-{calib['top_k']}; "
                         f"this one has {m.num_layers}, {m.num_experts}, top-{m.top_k})")
    tokens = calib["routing"]["tokens"]
    if tokens <= 0:
        raise InputError("the calibration routed no tokens: no routing to predict from")
    counts = calib["routing"]["counts"]
    return {l: [c / tokens for c in counts[l]] for l in range(m.num_layers) if m.moe_layers[l]}


def uniform_probs(m: ModelSpec) -> dict[int, list[float]]:
    return {l: [m.top_k / m.num_experts] * m.num_experts for l in range(m.num_layers) if m.moe_layers[l]}


def used_prob(p: float, batch: int) -> float:
    """Probability that an expert a token picks with probability ``p`` is picked by one of ``batch``
    independent tokens."""
    return 1.0 - (1.0 - min(max(p, 0.0), 1.0)) ** batch


def expected_distinct(probs: list[float], batch: int) -> float:
    """Expected distinct experts ``batch`` independent tokens touch in one layer."""
    return sum(used_prob(p, batch) for p in probs)


# ---- formats and placement ------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertLayout:
    """Per MoE layer: each original expert's (fc, proj) format and the placement (slot -> expert)."""

    formats: dict[int, list[tuple[str, str]]]
    placement: dict[int, list[int]]
    source: str

    @classmethod
    def uniform(cls, m: ModelSpec, fmt: str | None) -> "ExpertLayout":
        f = fmt or FLOAT
        layers = [l for l in range(m.num_layers) if m.moe_layers[l]]
        return cls({l: [(f, f)] * m.num_experts for l in layers}, {}, f"experts {f}")

    @classmethod
    def from_checkpoint_config(cls, cfg, where: str) -> "ExpertLayout":
        """A converted checkpoint's plan (``CheckpointConfig`` of its config.json): slot formats
        un-permuted to original experts, and its placement."""
        from_slots = (cfg.raw.get("trtmoe") or {}).get("quantization") or {}
        placement = {int(l): [int(x) for x in p] for l, p in (from_slots.get("placement") or {}).items()}
        formats = {}
        for l in range(cfg.num_layers):
            if not cfg.moe_layers[l]:
                continue
            _, fc, proj = slot_formats(cfg, l)
            perm = placement.get(l, list(range(cfg.num_experts)))
            fs = [(FLOAT, FLOAT)] * cfg.num_experts
            for s, e in enumerate(perm):
                fs[e] = (fc[s], proj[s])
            formats[l] = fs
        return cls(formats, placement, f"plan of {where}")


class _ExpertBytes:
    """Bytes of one expert (fc + proj) per (format pair, FFN width), memoised."""

    def __init__(self, H: int, dtype: torch.dtype):
        self.H, self.dtype = H, dtype
        self._memo: dict = {}

    def __call__(self, pair: tuple[str, str], I: int) -> int:
        key = (pair, I)
        if key not in self._memo:
            self._memo[key] = (matrix_cost_bits(pair[0], "fc", I, self.H, self.dtype)
                               + matrix_cost_bits(pair[1], "proj", I, self.H, self.dtype)) // 8
        return self._memo[key]


# ---- the prediction --------------------------------------------------------------------------------
def _nonexpert_bytes(m: ModelSpec, mapping: Mapping, dtype: torch.dtype) -> list[dict[str, int]]:
    """Per rank: bytes of its non-expert weights read every step, the embedding table apart."""
    out = []
    for r in mapping.ranks():
        by: dict[str, int] = {"static": 0, "embedding": 0, "embedding_row": 0}
        for s in rank_specs(m, mapping, r, dtype):
            if s.role in ("expert_fc", "expert_proj"):
                continue
            if s.role == "embedding":
                by["embedding"] += s.nbytes
                by["embedding_row"] += s.nbytes // max(1, s.shape[0])
            else:
                by["static"] += s.nbytes
        out.append(by)
    return out


def kv_bytes_per_token(m: ModelSpec, kv_element_bytes: int, mapping: Mapping | None = None,
                       layers: int | None = None) -> int:
    """KV-cache bytes one token of context holds (keys and values of every layer; per TP rank of
    ``mapping`` when given, KV heads duplicated where fewer than tp)."""
    heads = m.num_kv_heads if mapping is None else mapping.kv_heads_per_rank(m.num_kv_heads)
    return 2 * (m.num_layers if layers is None else layers) * heads * m.head_dim * kv_element_bytes


def _ep_groups(mapping: Mapping, E: int, perm: list[int] | None) -> list[list[int]]:
    """Original experts held by each EP rank under ``perm`` (slot -> expert; None = contiguous)."""
    return mapping.ep_groups(perm or list(range(E)))


_BUSIEST: dict = {}


def expected_busiest(groups: list[tuple[list[float], list[int]]]) -> float:
    """E[max over groups of the bytes a step reads there]: a group (an EP rank) holds experts read
    with probabilities ``q`` and of sizes ``b``. Approximation: experts read independently (one
    token's k picks are not), and a group's bytes are its read count times its mean expert size
    (exact for one format per group). One group: exactly Σ q·b."""
    key = tuple((tuple(q), tuple(b)) for q, b in groups)
    if key in _BUSIEST:
        return _BUSIEST[key]
    if len(groups) == 1:
        out = float(sum(x * y for x, y in zip(*groups[0])))
    else:
        dists = []
        for q, b in groups:
            pmf = np.array([1.0])
            for x in q:
                pmf = np.convolve(pmf, [1.0 - x, x])
            tq = sum(q)
            size = sum(x * y for x, y in zip(q, b)) / tq if tq > 0 else 0.0
            dists.append((np.arange(len(pmf)) * size, np.cumsum(pmf)))
        grid = np.unique(np.concatenate([v for v, _ in dists]))
        cdf = np.ones_like(grid)
        for v, c in dists:
            at = np.searchsorted(v, grid, side="right") - 1
            cdf *= np.where(at >= 0, c[np.clip(at, 0, None)], 0.0)
        out = float((grid * np.diff(np.concatenate([[0.0], cdf]))).sum())
    if len(_BUSIEST) > 100_000:
        _BUSIEST.clear()
    _BUSIEST[key] = out
    return out


def rank_imbalance(probs: dict[int, list[float]], bytes_of: dict[int, list[int]], mapping: Mapping, batch: int,
                   placement: dict[int, list[int]] | None) -> dict:
    """Expected tokens and expert bytes per step of the hottest EP rank against the mean, per layer and
    summed over layers (Σ_l max_r / Σ_l mean_r: ranks wait for the busiest one at every layer): the
    busiest rank of the expectations (``*_max_over_mean``), and for bytes also the expected busiest rank
    of a step (``bytes_expected_max_over_mean``, see ``expected_busiest``), which is higher: at small
    batches a few ranks hold all the experts a step reads."""
    ep = mapping.moe_ep_size
    tok_max = tok_mean = byte_max = byte_mean = byte_emax = 0.0
    per_layer = {}
    for l, p in probs.items():
        groups = _ep_groups(mapping, len(p), (placement or {}).get(l))
        toks = [batch * sum(p[e] for e in g) for g in groups]
        byts = [sum(used_prob(p[e], batch) * bytes_of[l][e] for e in g) for g in groups]
        emax = expected_busiest([([used_prob(p[e], batch) for e in g], [bytes_of[l][e] for e in g]) for g in groups])
        mt, mb = sum(toks) / ep, sum(byts) / ep
        tok_max, tok_mean, byte_max, byte_mean = tok_max + max(toks), tok_mean + mt, byte_max + max(byts), \
            byte_mean + mb
        byte_emax += emax
        per_layer[l] = {"tokens_max_over_mean": max(toks) / mt if mt else 1.0,
                        "bytes_max_over_mean": max(byts) / mb if mb else 1.0,
                        "bytes_expected_max_over_mean": emax / mb if mb else 1.0}
    return {"tokens_max_over_mean": tok_max / tok_mean if tok_mean else 1.0,
            "bytes_max_over_mean": byte_max / byte_mean if byte_mean else 1.0,
            "bytes_expected_max_over_mean": byte_emax / byte_mean if byte_mean else 1.0,
            "hottest_rank_expert_bytes": byte_max, "expected_busiest_rank_expert_bytes": byte_emax,
            "mean_rank_expert_bytes": byte_mean, "layers": per_layer}


def predict_step(m: ModelSpec, mapping: Mapping, dtype: torch.dtype, probs: dict[int, list[float]],
                 experts: ExpertLayout, batch: int, context: int, kv_element_bytes: int, gpu: GPU,
                 nonexpert: list[dict[str, int]] | None = None, model_nonexpert: dict[str, int] | None = None
                 ) -> dict:
    """One batch size under one routing: distinct experts, bytes per step (whole deployment and per
    rank) and the roofline's steps per second."""
    nonexpert = nonexpert if nonexpert is not None else _nonexpert_bytes(m, mapping, dtype)
    model_nonexpert = model_nonexpert or _nonexpert_bytes(m, Mapping(), dtype)[0]
    eb = _ExpertBytes(m.hidden_size, dtype)
    I_full, I_loc = m.expert_intermediate_size, mapping.expert_ffn_per_rank(m.expert_intermediate_size)
    full_bytes = {l: [eb(experts.formats[l][e], I_full) for e in range(m.num_experts)] for l in probs}
    local_bytes = {l: [eb(experts.formats[l][e], I_loc) for e in range(m.num_experts)] for l in probs}
    used = {l: [used_prob(p, batch) for p in ps] for l, ps in probs.items()}
    distinct = {l: sum(u) for l, u in used.items()}
    expert_bytes = sum(u * b for l in probs for u, b in zip(used[l], full_bytes[l]))
    all_expert_bytes = sum(sum(b) for b in full_bytes.values())
    emb_rows = min(batch, m.vocab_size)
    # The model's own figures: one copy of every weight (as on one GPU); the ranks' follow.
    dense = model_nonexpert["static"] + emb_rows * model_nonexpert["embedding_row"]
    kv = batch * context * kv_bytes_per_token(m, kv_element_bytes)
    # Per rank and the roofline.
    ranks, step_s = [], 0.0
    for pp in range(mapping.pp_size):
        layers = mapping.pp_layers(m.num_layers, pp)
        members = [mapping.rank(t, pp) for t in range(mapping.tp_size)]
        stage_nonexpert = 0.0
        for r in members:
            held = mapping.ep_experts(m.num_experts, r)
            kv_r = batch * context * kv_bytes_per_token(m, kv_element_bytes, mapping, len(layers))
            ne = nonexpert[r]["static"] + emb_rows * nonexpert[r]["embedding_row"]
            exp_r = 0.0
            for l in layers:
                if l not in probs:
                    continue
                perm = experts.placement.get(l, list(range(m.num_experts)))
                b = sum(used[l][perm[s]] * local_bytes[l][perm[s]] for s in held)
                exp_r += b
            ranks.append({"rank": r, "pp_rank": pp, "moe_ep_rank": mapping.moe_ep_rank(r),
                          "nonexpert_bytes": ne, "expert_bytes": exp_r, "kv_bytes": kv_r,
                          "bytes": ne + exp_r + kv_r})
            stage_nonexpert = max(stage_nonexpert, ne + kv_r)
        # Per MoE layer the expected busiest EP rank's expert bytes (the moe_tp ranks of one EP rank
        # read equal shares of its experts).
        busiest = 0.0
        for l in layers:
            if l in probs:
                perm = experts.placement.get(l, list(range(m.num_experts)))
                groups = _ep_groups(mapping, m.num_experts, perm)
                busiest += expected_busiest([([used[l][e] for e in g], [local_bytes[l][e] for e in g])
                                             for g in groups])
        step_s += (stage_nonexpert + busiest) / gpu.bandwidth
    n_moe = len(probs)
    return {
        "batch": batch,
        "distinct_experts_per_layer": {str(l): d for l, d in distinct.items()},
        "distinct_experts_mean": sum(distinct.values()) / n_moe if n_moe else 0.0,
        "expert_coverage": (sum(distinct.values()) / (n_moe * m.num_experts)) if n_moe else 0.0,
        "expert_bytes": expert_bytes,
        "expert_bytes_share": expert_bytes / all_expert_bytes if all_expert_bytes else 0.0,
        "nonexpert_bytes": dense, "weight_bytes": dense + expert_bytes, "kv_bytes": kv,
        "bytes_per_step": dense + expert_bytes + kv,
        "ranks": ranks,
        "step_seconds": step_s, "steps_per_s": 1.0 / step_s if step_s > 0 else math.inf,
        "tokens_per_s": batch / step_s if step_s > 0 else math.inf,
    }


def what_it_moves(m: ModelSpec, mapping: Mapping, dtype: torch.dtype, *, batches=DEFAULT_BATCHES,
                  calib: dict | None = None, experts: ExpertLayout | None = None, context: int | None = None,
                  gpu: GPU | None = None, kv_element_bytes: int | None = None) -> dict:
    """Per batch size, under uniform routing and (with ``calib``) the measured one: expected distinct
    experts per MoE layer, weight / KV bytes per step (whole deployment and per rank), the bandwidth
    roofline; and the EP ranks' imbalance under contiguous, balanced (and the plan's) placement."""
    gpu = gpu or GPUS["H100"]
    if context is None:  # DEFAULT_CONTEXT tokens, or the model's whole context when shorter
        context = min(DEFAULT_CONTEXT, m.max_position_embeddings)
    if context < 0 or context > m.max_position_embeddings:
        raise InputError(f"--context {context}: a stream holds 0 to max_position_embeddings = "
                         f"{m.max_position_embeddings} tokens")
    batches = parse_batches(batches)
    experts = experts or ExpertLayout.uniform(m, None)
    kv_b = kv_element_bytes or torch.empty((), dtype=dtype).element_size()
    nonexpert = _nonexpert_bytes(m, mapping, dtype)
    one = nonexpert[0] if mapping.world_size == 1 else _nonexpert_bytes(m, Mapping(), dtype)[0]
    routings = {"uniform": uniform_probs(m)}
    if calib is not None:
        routings["measured"] = inclusion_probs(calib, m)
    rows = []
    for b in batches:
        row = {"batch": b}
        for name, probs in routings.items():
            row[name] = predict_step(m, mapping, dtype, probs, experts, b, context, kv_b, gpu, nonexpert, one)
        rows.append(row)
    out = {
        "routing": "measured" if calib is not None else "uniform",
        "experts": experts.source,
        "gpu": {"name": gpu.name, "bandwidth_bytes_per_s": gpu.bandwidth, "source": gpu.source},
        "context": context, "kv_element_bytes": kv_b,
        "kv_bytes_per_token": kv_bytes_per_token(m, kv_b),
        "batches": rows,
        "assumptions": list(ASSUMPTIONS),
    }
    out["placement"] = _placements(m, mapping, dtype, routings, experts, batches, calib)
    return out


def _placements(m: ModelSpec, mapping: Mapping, dtype: torch.dtype, routings: dict, experts: ExpertLayout,
                batches: list[int], calib: dict | None) -> dict:
    """Hottest EP rank over the mean, per batch, for each placement, under the measured routing (the
    uniform one when there is no calibration, where every placement is even in expectation)."""
    probs = routings.get("measured", routings["uniform"])
    eb = _ExpertBytes(m.hidden_size, dtype)
    I_loc = mapping.expert_ffn_per_rank(m.expert_intermediate_size)
    bytes_of = {l: [eb(experts.formats[l][e], I_loc) for e in range(m.num_experts)] for l in probs}
    ep = mapping.moe_ep_size
    placements: dict[str, dict[int, list[int]] | None] = {"contiguous": None}
    if calib is not None and ep > 1:
        counts = calib["routing"]["counts"]
        placements["balanced"] = {l: balanced_permutation([float(c) for c in counts[l]], mapping) for l in probs}
    if experts.placement:
        placements["plan"] = experts.placement
    out = {"moe_ep": ep, "routing": "measured" if calib is not None else "uniform", "placements": {}}
    if ep == 1:
        out["note"] = "one expert-parallel rank (moe_ep=1): every rank holds every expert"
    for name, perm in placements.items():
        out["placements"][name] = [{"batch": b, **rank_imbalance(probs, bytes_of, mapping, b, perm)}
                                   for b in batches]
    if "balanced" in placements:
        out["note"] = ("balanced: the permutation `convert --placement balanced` writes, computed from this "
                       "calibration's counts (in-sample)")
    return out


# ---- the command's report ---------------------------------------------------------------------------
def moves_report(model: str, *, tp: int = 1, pp: int = 1, moe_tp: int | None = None, moe_ep: int | None = None,
                 dtype: str = "auto", fmt: str | None = None, plan: str | Path | None = None,
                 calib: str | Path | None = None, batch=None, context: int | None = None,
                 gpu: str | None = None) -> dict:
    """``what_it_moves`` for ``inspect``'s model and layout: ``calib`` a calibration directory (or
    calib.json), ``plan`` a converted checkpoint whose per-expert formats and placement are used
    (instead of one ``fmt`` for every routed expert). Raises LayoutError for an impossible layout."""
    _, m, _ = describe_model(model)
    tdtype = parse_dtype(m.source_dtype if dtype == "auto" and m.source_dtype in DTYPE_STR.values()
                         else ("float32" if dtype == "auto" else dtype))
    mapping = Mapping.create(tp, pp, moe_tp, moe_ep)
    mapping.validate(m)
    if plan is not None:
        cfg = load_config(plan)
        if (cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.hidden_size) != \
                (m.num_layers, m.num_experts, m.top_k, m.hidden_size):
            raise InputError("the checkpoint holds another model", where=str(plan))
        experts = ExpertLayout.from_checkpoint_config(cfg, str(plan))
        if cfg.mapping.moe_ep_size != mapping.moe_ep_size and experts.placement:
            experts = ExpertLayout(experts.formats, {}, experts.source + " (its placement is for moe_ep="
                                   f"{cfg.mapping.moe_ep_size}; contiguous here)")
    else:
        experts = ExpertLayout.uniform(m, None if fmt in (None, "float", "fp16", "bf16", "fp32") else fmt)
    cal = load_calib(calib) if calib is not None else None
    out = what_it_moves(m, mapping, tdtype, batches=parse_batches(batch), calib=cal, experts=experts,
                        context=context, gpu=parse_gpu(gpu))
    out["layout"] = mapping.summary()
    out["dtype"] = DTYPE_STR[tdtype]
    out["model"] = {"num_moe_layers": m.num_moe_layers, "num_experts": m.num_experts, "top_k": m.top_k}
    return out


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g}" if n < 1e11 else f"{n / 1e9:,.0f}"


def render_moves(rep: dict, console) -> None:
    """The human form of ``moves_report``: one table per routing, then the EP placements."""
    g = rep["gpu"]
    routings = ["measured", "uniform"] if rep["routing"] == "measured" else ["uniform"]
    lay = rep["layout"]
    console.print(f"[bold]What a decode step moves[/] ({rep['dtype']}, {rep['experts']}, tp={lay['tp']} "
                  f"pp={lay['pp']} moe_tp={lay['moe_tp']} moe_ep={lay['moe_ep']}; context {rep['context']} "
                  f"tokens per stream; {g['name']} at {g['bandwidth_bytes_per_s'] / 1e12:.3g} TB/s — "
                  f"{g['source']})")
    E = rep["model"]["num_experts"]
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left",
              title=f"Per decode step ({rep['model']['num_moe_layers']} MoE layers × {E} experts, "
                    f"top-{rep['model']['top_k']})")
    for col in ("B", "routing", "distinct", "cover", "weights", "experts", "KV", "top rank", "steps/s",
                "tok/s"):
        t.add_column(col, justify="left" if col == "routing" else "right")
    for row in rep["batches"]:
        for i, name in enumerate(routings):
            r = row[name]
            busiest = max(x["bytes"] for x in r["ranks"])
            t.add_row(str(row["batch"]) if i == 0 else "", name[:4], f"{r['distinct_experts_mean']:.1f}",
                      f"{100 * r['expert_coverage']:.0f}%", _gb(r["weight_bytes"]), _gb(r["expert_bytes"]),
                      _gb(r["kv_bytes"]), _gb(busiest), f"{r['steps_per_s']:,.0f}",
                      f"{r['tokens_per_s']:,.0f}")
        if len(routings) > 1 and row is not rep["batches"][-1]:
            t.add_section()
    console.print(t)
    console.print(f"  [dim]distinct: expected distinct experts (of {E}) a step reads per MoE layer (cover: share); "
                  "weights: GB read per step (experts: of which routed experts); KV: GB of cache read; top rank: "
                  "GB the busiest rank reads; steps/s and tok/s: the memory-bandwidth roofline; meas: measured "
                  "routing, unif: uniform[/]")
    pl = rep["placement"]
    if pl["moe_ep"] > 1:
        t = Table(box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left",
                  title=f"Hottest expert-parallel rank / mean ({pl['routing']} routing, moe_ep={pl['moe_ep']}, "
                        "summed over MoE layers)")
        t.add_column("placement")
        for row in rep["batches"]:
            t.add_column(f"{row['batch']}: tok", justify="right")
            t.add_column(f"{row['batch']}: bytes", justify="right")
        for name, rows in pl["placements"].items():
            t.add_row(name, *[v for x in rows for v in (
                f"{x['tokens_max_over_mean']:.2f}×",
                f"{x['bytes_max_over_mean']:.2f}× ({x['bytes_expected_max_over_mean']:.1f}×)")])
        console.print(t)
        console.print("  [dim]tok, bytes: the busiest rank's expected tokens and expert bytes over the mean; in "
                      "brackets the expected bytes of a step's busiest rank over the mean[/]")
    if pl.get("note"):
        console.print(f"  [dim]{pl['note']}[/]")
    for a in rep["assumptions"]:
        console.print(f"  [dim]assumes {a}[/]")
