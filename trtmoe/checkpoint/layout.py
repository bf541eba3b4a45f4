"""What a TensorRT-LLM checkpoint holds: config.json and, per rank, every tensor's name, shape, dtype
and how to produce its bytes from the HF source, by interpreting the architecture registry's rule
table (``trtmoe.hf.adapters``). The writer streams these specs; ``inspect`` sums them for per-rank
bytes; tests compare them with the reference tables. One source of truth.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Union

import torch

from .. import DEFAULT_TRTLLM_VERSION
from ..errors import InputError
from ..hf.adapters import (ADAPTERS, EP, FIRST, FLOAT32, KV_HEADS, LAST, MOE_TP, REPLICATED, TP, VOCAB, Rule,
                           expert_rules, global_rules, layer_rules)
from ..hf.reader import all_finite
from ..hf.safetensors_io import SourceRange
from ..model.description import ModelSpec
from ..model.params import role_shapes
from ..parallel.mapping import Mapping
from ..quant import awq, fp_gptq
from ..quant.formats import FORMATS
from ..quant.plan import format_obj
from .schema import MAPPING_KEYS, schema_for

_CHUNK = 16 << 20  # source bytes read per step when a tensor must be cast or column-sliced

# A producer writes exactly the declared bytes of one tensor, chunk by chunk, via ``emit``. A chunk
# is a tensor (which may be a view of a reused buffer: ``emit`` consumes it before returning) or a
# ``SourceRange``: bytes of a source file that are already exactly the output bytes, copied verbatim.
Emit = Callable[[Union[torch.Tensor, SourceRange]], None]
Producer = Callable[[Emit], None]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Producer | None = None
    role: str = ""  # e.g. "expert_fc" — used for accounting

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


DTYPE_STR = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def trtllm_config(m: ModelSpec, mapping: Mapping, dtype: torch.dtype, *, version: str = DEFAULT_TRTLLM_VERSION,
                  quantization: dict | None = None, extra: dict | None = None) -> dict:
    """The checkpoint ``config.json`` for the target TensorRT-LLM release line: the keys every
    architecture shares, then the architecture's own (``Adapter.trtllm_facts``)."""
    adapter = ADAPTERS[m.family]
    schema = schema_for(version)
    mp = mapping.to_dict()
    assert set(MAPPING_KEYS) <= schema["mapping"]
    moe = {"num_experts": m.num_experts, "top_k": m.top_k, "normalization_mode": m.normalization_mode,
           "sparse_mixer_epsilon": m.sparse_mixer_epsilon, "tp_mode": 0,
           "shared_expert_intermediate_size": m.shared_expert_intermediate_size,
           "device_limited_n_group": 0, "device_limited_topk_group": 0,
           "device_limited_routed_scaling_factor": 1.0}
    moe = {k: v for k, v in moe.items() if k in schema["moe"]}
    quant = {"quant_algo": None, "kv_cache_quant_algo": None}
    quant.update(quantization or {})
    cfg = {
        "architecture": adapter.trtllm_architecture,
        "dtype": DTYPE_STR[dtype],
        "logits_dtype": "float32",
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_size": m.head_dim,
        "hidden_act": "swiglu",
        "norm_epsilon": m.norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": m.max_position_embeddings,
        "rotary_base": m.rope_theta,
        "rotary_scaling": None,
        "mlp_bias": False,
        "attn_bias": m.qkv_bias,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "tie_word_embeddings": m.tie_word_embeddings,
        "moe": moe,
        "mapping": mp,
        "quantization": quant,
        **adapter.trtllm_facts(m),
    }
    # trtmoe's own facts, under one top-level key (TensorRT-LLM tolerates extra top-level keys).
    cfg["trtmoe"] = {"family": m.family, "moe_layers": list(m.moe_layers),
                     "bos_token_id": m.bos_token_id, "eos_token_id": m.eos_token_id, **(extra or {})}
    return cfg


class RankLayout:
    """Tensor specs of one rank. ``src`` is an HFCheckpoint (or None for pure accounting)."""

    def __init__(self, m: ModelSpec, mapping: Mapping, rank: int, dtype: torch.dtype, src=None, plan=None,
                 device: torch.device | str = "cpu"):
        self.m, self.mp, self.rank, self.dtype, self.src = m, mapping, rank, dtype, src
        # Where the plan's INT4 searches run (``convert --device``): the rounding's searches compute
        # there; what they give back is on the host.
        self.device = torch.device(device)
        self.tp_rank = mapping.tp_rank(rank)
        self.pp_rank = mapping.pp_rank(rank)
        self.plan = plan  # optional trtmoe.quant.plan.QuantPlan
        # Activation-aware int4 (plan.meta["rounding"] == "awq"); None = round to nearest.
        self.rounding = awq.rounding_for_plan(plan, dtype, self.device) if plan is not None else None

    # -- helpers ----------------------------------------------------------------------------------
    def _rows(self, emit: Emit, role: str, layer: int | None, a: int | None = None, b: int | None = None,
              expert=None, dtype: torch.dtype | None = None) -> None:
        """Emit rows ``[a, b)`` (all when None) of a source tensor in ``dtype`` (default: the model's):
        a verbatim byte range when the stored dtype already matches, else cast a chunk at a time."""
        dtype = dtype or self.dtype
        rows = None if a is None else (a, b)
        rng = self.src.role_range(role, layer, expert, rows=rows, dtype=dtype)
        if rng is not None:
            emit(rng)
            return
        self._chunked(emit, role, layer, expert, rows, None, dtype)

    def _cols(self, emit: Emit, role: str, layer: int | None, a: int, b: int, expert=None) -> None:
        """Emit columns ``[a, b)`` of a 2-D source tensor in the model dtype, a chunk of rows at a time."""
        self._chunked(emit, role, layer, expert, None, (a, b), self.dtype)

    def _chunked(self, emit: Emit, role: str, layer: int | None, expert, rows, cols, dtype) -> None:
        """Read ``rows`` (all when None) about ``_CHUNK`` bytes at a time into one reused buffer, check
        them for NaN/Inf, and emit each chunk's ``cols`` (all when None) cast to ``dtype``."""
        src = self.src
        name = src.adapter.name(role, layer, expert)
        info = src.info(name)
        if not info.shape:
            emit(src.read(name, dtype=dtype))
            return
        a, b = rows if rows is not None else (0, info.shape[0])
        row_bytes = info.nbytes // max(1, info.shape[0])
        step = max(1, _CHUNK // max(1, row_bytes))
        buf = torch.empty(min(b - a, step) * row_bytes, dtype=torch.uint8)
        for r in range(a, b, step):
            t = src.read(name, (r, min(b, r + step)), check_finite=False, out=buf)
            if t.dtype != dtype:  # checked after the cast, which may overflow
                emit(src.cast(t if cols is None else t[:, cols[0]:cols[1]], dtype, name, rows))
                continue
            if t.is_floating_point() and not all_finite(t):
                raise src.nonfinite_error(name, rows)
            emit(t if cols is None else t[:, cols[0]:cols[1]])

    def specs(self) -> list[TensorSpec]:
        """Every tensor of this rank, in file order: the registry's rules that apply, interpreted."""
        m, mp = self.m, self.mp
        out: list[TensorSpec] = []
        if mp.is_first_pp_rank(self.rank):
            out.extend(self._spec("", rule, None) for rule in global_rules(m, FIRST))
        for j, l in enumerate(mp.pp_layers(m.num_layers, self.pp_rank)):
            p = layer_prefix(j)
            rules = layer_rules(m, l)
            experts = [rule for rule in rules if rule.shard == MOE_TP]
            for rule in rules:
                if rule.shard != MOE_TP:
                    out.append(self._spec(p, rule, l))
                elif rule is experts[0]:  # the routed experts' tensors are written as one group
                    out.extend(self._experts(p, l, experts))
        if mp.is_last_pp_rank(self.rank):
            out.extend(self._spec("", rule, None) for rule in global_rules(m, LAST))
        return out

    # -- one rule -> one tensor ---------------------------------------------------------------------
    def _spec(self, prefix: str, rule: Rule, l: int | None) -> TensorSpec:
        m, mp, r = self.m, self.mp, self.tp_rank
        roles = rule.source_roles(m)
        zeros = rule.zeros(m)
        # A tensor the source lacks has the shape it would have if the source had it.
        shapes = role_shapes(dataclasses.replace(m, **{rule.when: True}) if zeros else m, l)
        src_shape = [shapes[role] for role in rule.roles]
        dt = torch.float32 if rule.dtype == FLOAT32 else self.dtype
        ax = rule.axis
        if rule.shard == REPLICATED:
            shape = _concat(src_shape, ax)

            def produce(emit):
                for role in roles:
                    self._rows(emit, role, l, dtype=dt)
        elif rule.shard == EP:
            shape = src_shape[0]
            perm = self._perm(l)

            def produce(emit, role=roles[0]):  # rows in slot order: the plan's expert placement
                w = self.src.role(role, l).to(dt)
                emit(w[perm] if perm != list(range(len(perm))) else w)
        elif rule.shard == TP:
            parts = [tuple(mp.tp_shard(d) if i == ax else d for i, d in enumerate(sh)) for sh in src_shape]
            shape = _concat(parts, ax)

            def produce(emit):
                for role, sh in zip(roles, src_shape):
                    rng = mp.tp_range(sh[ax], r)
                    if ax == 0:
                        self._rows(emit, role, l, rng.start, rng.stop)
                    else:
                        self._cols(emit, role, l, rng.start, rng.stop)
        elif rule.shard == KV_HEADS:
            hd, nh = m.head_dim, mp.heads_per_rank(m.num_heads)
            qr = mp.tp_range(m.num_heads, r)
            kvr = mp.kv_head_range(m.num_kv_heads, r)
            shape = ((nh + 2 * len(kvr)) * hd, *src_shape[0][1:])

            def produce(emit):
                self._rows(emit, roles[0], l, qr.start * hd, qr.stop * hd)
                for role in roles[1:]:
                    self._rows(emit, role, l, kvr.start * hd, kvr.stop * hd)
        elif rule.shard == VOCAB:
            V = m.vocab_size
            rows = mp.vocab_range(V, r)
            a, b = rows.start, rows.stop
            shape = (len(rows), *src_shape[0][1:])

            def produce(emit, role=roles[0]):
                if a < min(b, V):
                    self._rows(emit, role, l, a, min(b, V))
                if b > max(a, V):  # zero rows that pad the vocabulary to a multiple of tp
                    emit(torch.zeros(b - max(a, V), *shape[1:], dtype=dt))
        else:
            raise AssertionError(f"unknown shard kind {rule.shard!r}")
        if zeros:
            def produce(emit, shape=tuple(shape)):
                emit(torch.zeros(shape, dtype=dt))
        return TensorSpec(prefix + rule.name, tuple(shape), dt, produce, rule.kind)

    def _perm(self, l: int) -> list[int]:
        E = self.m.num_experts
        return self.plan.perm(l, E) if self.plan is not None else list(range(E))

    # -- routed experts -------------------------------------------------------------------------------
    def expert_matrix(self, l: int, e: int, t: int, I_loc: int, mod: str) -> torch.Tensor:
        """One matrix of original expert ``e``'s moe_tp shard ``t`` in the model dtype: ``fc``
        [2·I_loc, H] = [up; gate] or ``proj`` [H, I_loc] (the roles of the registry's rule)."""
        rule = self._expert_rules[mod]
        a, b = t * I_loc, (t + 1) * I_loc
        if rule.axis == 0:
            return torch.cat([self.src.role(role, l, e, rows=(a, b), dtype=self.dtype) for role in rule.roles])
        return self.src.role(rule.roles[0], l, e, dtype=self.dtype)[:, a:b]

    def _recipe(self, fmt, l: int, e: int, t: int, I_loc: int, mod: str, w: torch.Tensor, shared: bool):
        """The activation-aware transform of one expert matrix shard (None: round to nearest)."""
        if self.rounding is None:
            return None
        I = self.m.expert_intermediate_size
        return self.rounding.recipe(fmt, l, e, mod, (t, I_loc), w,
                                    lambda x: self.expert_matrix(l, x, 0, I, mod),
                                    list(range(self.m.num_experts)) if shared else None,
                                    matrix=lambda x, m: self.expert_matrix(l, x, 0, I, m))

    def _quantized(self, fmt, l: int, e: int, t: int, I_loc: int, mod: str, shared: bool = False) -> dict:
        """Packed tensors of original expert ``e``'s ``mod`` shard in ``fmt``, with the plan's rounding."""
        w = self.expert_matrix(l, e, t, I_loc, mod)
        amax = self._input_amax(l, mod, w.shape[-1]) if fmt.needs_input_amax else None
        if self.rounding is None:
            return fmt.quantize(w, dtype=self.dtype, input_amax=amax)
        if fp_gptq.applies(fmt):  # FP8 / FP8-block / NVFP4 / MXFP4: the calibration's rounding of them
            I = self.m.expert_intermediate_size
            return self.rounding.fp_quantize(fmt, l, e, mod, (t, I_loc), w, amax,
                                             matrix=lambda x, m: self.expert_matrix(l, x, 0, I, m))
        return awq.apply(fmt, w, self.dtype, self._recipe(fmt, l, e, t, I_loc, mod, w, shared), input_amax=amax)

    def _input_amax(self, l: int, mod: str, width: int) -> torch.Tensor:
        """The calibrated input amax of layer ``l``'s ``mod`` matrices (the plan carries it from the
        calibration, ``meta["input_amax"]``): per input channel when this shard sees every channel,
        else the layer's maximum (one input scale serves all shards and experts)."""
        got = ((self.plan.meta.get("input_amax") or {}).get(str(l)) or {}).get(mod) if self.plan else None
        if got is None:
            raise InputError(f"layer {l}'s {mod} inputs have no calibrated amax, which a format with a static "
                             "input scale needs", hint="pass --calib with a calibration made by this trtmoe")
        a = torch.as_tensor(got, dtype=torch.float32)
        return a if a.numel() == width else a.amax()

    def _experts(self, p: str, l: int, rules: list[Rule]) -> list[TensorSpec]:
        m, mp, plan = self.m, self.mp, self.plan
        self._expert_rules = {mod: rule for mod, rule in expert_rules(m).items() if rule in rules}
        slots = mp.ep_experts(m.num_experts, self.rank)
        t = mp.moe_tp_rank(self.rank)
        I_loc = mp.expert_ffn_per_rank(m.expert_intermediate_size)
        perm = self._perm(l)
        orig = [perm[s] for s in slots]
        kind = "float" if plan is None else ("expert" if plan.per_expert_layout else plan.layer_format(l))
        if kind == "expert":
            return self._per_expert(p, l, slots, orig, t, I_loc)
        if packed_at_conversion(kind):
            return self._stacked_packed(p, l, orig, t, I_loc, kind)
        # Float weights; for W8A16/W4A16 layers trtllm-build quantizes them itself, for the GPU it
        # builds on (and the embedded engine quantizes them the same way at load). With awq rounding a
        # W4A16 layer stores each expert matrix clamped to its searched per-row clip, so that the
        # amax / 8 quantization trtllm-build does lands on the clipped scale.
        clip_fmt = FORMATS.get(kind) if self.rounding is not None else None
        if clip_fmt is not None and clip_fmt.quantized_by_builder and awq.applies(clip_fmt):
            return self._clipped_float(p, l, orig, t, I_loc, rules, clip_fmt)
        specs = []
        for rule in rules:
            shape = role_shapes(m, l)[rule.roles[0]]
            per = tuple(mp.expert_ffn_per_rank(d) if i == rule.axis else d for i, d in enumerate(shape))
            full = (len(orig), *_concat([per] * len(rule.roles), rule.axis))

            def produce(emit, rule=rule):
                for e in orig:
                    for role in rule.roles:
                        if rule.axis == 0:
                            self._rows(emit, role, l, t * I_loc, (t + 1) * I_loc, expert=e)
                        elif mp.moe_tp_size == 1:  # the whole expert: a verbatim copy when no cast is needed
                            self._rows(emit, role, l, expert=e)
                        else:
                            self._cols(emit, role, l, t * I_loc, (t + 1) * I_loc, expert=e)

            specs.append(TensorSpec(p + rule.name, full, self.dtype, produce, rule.kind))
        return specs

    def _clipped_float(self, p: str, l: int, orig: list[int], t: int, I_loc: int, rules: list[Rule], fmt):
        specs = []
        for mod, (out_f, in_f) in self._expert_matrix_shapes(I_loc):
            def produce(emit, mod=mod):
                for e in orig:
                    w = self.expert_matrix(l, e, t, I_loc, mod)
                    rec = self._recipe(fmt, l, e, t, I_loc, mod, w, False)
                    emit(awq.float_weight(fmt, w, self.dtype, rec))

            rule = self._expert_rules[mod]
            specs.append(TensorSpec(p + rule.name, (len(orig), out_f, in_f), self.dtype, produce, rule.kind))
        return specs

    def _expert_matrix_shapes(self, I_loc: int) -> list[tuple[str, tuple[int, int]]]:
        """(module, (out, in)) of each routed-expert matrix on this rank, from the registry's rules."""
        H = self.m.hidden_size
        return [(mod, (len(rule.roles) * I_loc, H) if rule.axis == 0 else (H, I_loc))
                for mod, rule in self._expert_rules.items()]

    def _stacked_packed(self, p: str, l: int, orig: list[int], t: int, I_loc: int, fmt_name: str):
        """One format for the whole layer, stacked [E_loc, ...] per packed tensor (AWQ-style layout)."""
        fmt = format_obj(fmt_name, self.dtype)
        specs = []
        for mod, (out_f, in_f) in self._expert_matrix_shapes(I_loc):
            for key, (shape, dtype, shared) in fmt.packed_specs(out_f, in_f, self.dtype).items():
                # a shared tensor (pre-quant or input scale) is one for every expert of the layer

                def produce(emit, mod=mod, key=key, shared=shared):
                    if key == "prequant_scaling_factor" and self.rounding is not None:  # the layer's searched one
                        I = self.m.expert_intermediate_size
                        emit(self.rounding.shared_prequant(
                            fmt, l, mod, (t, I_loc), lambda x: self.expert_matrix(l, x, 0, I, mod),
                            list(range(self.m.num_experts)), matrix=lambda x, m: self.expert_matrix(l, x, 0, I, m)))
                        return
                    for e in orig[:1] if shared else orig:
                        emit(self._quantized(fmt, l, e, t, I_loc, mod, shared=True)[key])

                full = shape if shared else (len(orig), *shape)
                specs.append(TensorSpec(expert_tensor(p, mod, key), full, dtype, produce, f"expert_{mod}"))
        return specs

    def _per_expert(self, p: str, l: int, slots, orig: list[int], t: int, I_loc: int):
        """trtmoe's per-expert variant (embedded engine only): every expert matrix under its own name,
        in its own format (fc and proj of one expert may differ at matrix granularity). TensorRT-LLM
        cannot build it; the config and quant_cfg.json say so."""
        specs = []
        for slot, e in zip(slots, orig):
            for mod, (out_f, in_f) in self._expert_matrix_shapes(I_loc):
                name = self.plan.slot_matrix_format(l, slot, mod, self.m.num_experts)
                fmt = format_obj(name, self.dtype)
                for key, (shape, dtype, _) in fmt.packed_specs(out_f, in_f, self.dtype).items():
                    def produce(emit, mod=mod, key=key, e=e, fmt=fmt):
                        emit(self._quantized(fmt, l, e, t, I_loc, mod)[key])

                    specs.append(TensorSpec(expert_tensor(p, mod, key, slot), shape, dtype, produce,
                                            f"expert_{mod}"))
        return specs


def layer_prefix(local_layer: int) -> str:
    """The prefix of a decoder layer's tensors in its PP stage's rank files (``local_layer``: its index
    within the stage); layer rules' names follow it."""
    return f"transformer.layers.{local_layer}."


def expert_tensor(prefix: str, mod: str, key: str = "", slot: int | None = None) -> str:
    """The rank-file name of a routed-expert tensor ``key`` of matrix ``mod`` ("fc" or "proj") of the
    layer whose ``layer_prefix`` is ``prefix``: the layer's stack ``mlp.{mod}.{key}`` or, with
    ``slot``, the per-expert variant's ``mlp.experts.{slot}.{mod}.{key}`` (``key`` "": the prefix
    every such tensor starts with)."""
    return f"{prefix}mlp.{mod}.{key}" if slot is None else f"{prefix}mlp.experts.{slot}.{mod}.{key}"


def packed_at_conversion(fmt_name: str) -> bool:
    """Layer-uniform formats whose bytes trtmoe packs itself (group-wise INT4, ModelOpt style); the
    per-channel weight-only formats stay float in the file and ``trtllm-build`` quantizes them."""
    return bool(getattr(FORMATS.get(fmt_name), "packed_at_conversion", False))


def rank_specs(m: ModelSpec, mapping: Mapping, rank: int, dtype: torch.dtype, src=None,
               plan=None) -> list[TensorSpec]:
    return RankLayout(m, mapping, rank, dtype, src, plan).specs()


def _concat(shapes: list[tuple[int, ...]], axis: int) -> tuple[int, ...]:
    """The shape of ``shapes`` concatenated along ``axis``."""
    out = list(shapes[0])
    out[axis] = sum(sh[axis] for sh in shapes)
    return tuple(out)

