"""What a TensorRT-LLM checkpoint holds: config.json and, per rank, every tensor's name, shape, dtype
and how to produce its bytes from the HF source. The writer streams these specs; ``inspect`` sums
them for per-rank bytes; tests compare them with the reference tables. One source of truth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import torch

from .. import DEFAULT_TRTLLM_VERSION
from ..hf.reader import all_finite
from ..hf.safetensors_io import SourceRange
from ..model.description import MoEModel
from ..parallel.mapping import Mapping
from .schema import MAPPING_KEYS, schema_for

_SHAPE_CACHE: dict = {}
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


def trtllm_config(m: MoEModel, mapping: Mapping, dtype: torch.dtype, *, version: str = DEFAULT_TRTLLM_VERSION,
                  quantization: dict | None = None, extra: dict | None = None) -> dict:
    """The checkpoint ``config.json`` for the target TensorRT-LLM release line."""
    schema = schema_for(version)
    mp = {"world_size": mapping.world_size, "gpus_per_node": mapping.gpus_per_node, "cp_size": 1,
          "tp_size": mapping.tp_size, "pp_size": mapping.pp_size, "moe_tp_size": mapping.moe_tp_size,
          "moe_ep_size": mapping.moe_ep_size}
    assert set(MAPPING_KEYS) <= schema["mapping"]
    moe = {"num_experts": m.num_experts, "top_k": m.top_k, "normalization_mode": m.normalization_mode,
           "sparse_mixer_epsilon": 0.01, "tp_mode": 0,
           "shared_expert_intermediate_size": m.shared_expert_intermediate_size,
           "device_limited_n_group": 0, "device_limited_topk_group": 0,
           "device_limited_routed_scaling_factor": 1.0}
    moe = {k: v for k, v in moe.items() if k in schema["moe"]}
    quant = {"quant_algo": None, "kv_cache_quant_algo": None}
    quant.update(quantization or {})
    cfg = {
        "architecture": {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                         "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v1": "DeepseekForCausalLM"}[m.family],
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
    }
    if m.family == "mixtral":
        cfg["intermediate_size"] = m.expert_intermediate_size
    else:
        cfg["intermediate_size"] = m.dense_intermediate_size or m.expert_intermediate_size
        cfg["moe_intermediate_size"] = m.expert_intermediate_size
    if m.family in ("qwen2_moe", "qwen3_moe"):
        cfg["qwen_type"] = m.family
        cfg["moe_shared_expert_intermediate_size"] = m.shared_expert_intermediate_size
        cfg["qk_layernorm"] = m.qk_norm
        cfg["seq_length"] = m.max_position_embeddings
        cfg["use_logn_attn"] = False
        # Stored for completeness; TensorRT-LLM's QWen model makes every layer MoE, which
        # `trtmoe build --backend tensorrt-llm` checks before building.
        cfg["mlp_only_layers"] = [l for l, moe_l in enumerate(m.moe_layers) if not moe_l]
        cfg["decoder_sparse_step"] = 1
    # trtmoe's own facts, under one top-level key (TensorRT-LLM tolerates extra top-level keys).
    cfg["trtmoe"] = {"family": m.family, "moe_layers": list(m.moe_layers),
                     "bos_token_id": m.bos_token_id, "eos_token_id": m.eos_token_id, **(extra or {})}
    return cfg


class RankLayout:
    """Tensor specs of one rank. ``src`` is an HFCheckpoint (or None for pure accounting)."""

    def __init__(self, m: MoEModel, mapping: Mapping, rank: int, dtype: torch.dtype, src=None, plan=None):
        self.m, self.mp, self.rank, self.dtype, self.src = m, mapping, rank, dtype, src
        self.tp_rank = mapping.tp_rank(rank)
        self.pp_rank = mapping.pp_rank(rank)
        self.plan = plan  # optional trtmoe.quant.plan.QuantPlan

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
        m, mp, tp, r = self.m, self.mp, self.mp.tp_size, self.tp_rank
        H, dt = m.hidden_size, self.dtype
        out: list[TensorSpec] = []
        add = out.append

        if mp.is_first_pp_rank(self.rank):
            add(TensorSpec("transformer.vocab_embedding.weight", (m.vocab_size, H), dt,
                           lambda emit: self._rows(emit, "embed", None, 0, m.vocab_size), "embedding"))

        for j, l in enumerate(mp.pp_layers(m.num_layers, self.pp_rank)):
            p = f"transformer.layers.{j}."
            add(TensorSpec(p + "input_layernorm.weight", (H,), dt,
                           self._full("input_norm", l), "norm"))
            out.extend(self._attention(p, l))
            add(TensorSpec(p + "post_layernorm.weight", (H,), dt, self._full("post_norm", l), "norm"))
            if m.moe_layers[l]:
                out.extend(self._moe(p, l))
            else:
                out.extend(self._dense(p, l))

        if mp.is_last_pp_rank(self.rank):
            add(TensorSpec("transformer.ln_f.weight", (H,), dt, self._full("final_norm", None), "norm"))
            vpad = mp.padded_vocab(m.vocab_size)
            per = vpad // tp
            a, b = r * per, (r + 1) * per
            head_role = "embed" if m.tie_word_embeddings else "lm_head"

            def lm_head(emit, a=a, b=b, role=head_role):
                real_b = min(b, m.vocab_size)
                if a < real_b:
                    self._rows(emit, role, None, a, real_b)
                if b > max(a, m.vocab_size):  # zero rows that pad the vocabulary to a multiple of tp
                    emit(torch.zeros(b - max(a, m.vocab_size), H, dtype=dt))

            add(TensorSpec("lm_head.weight", (per, H), dt, lm_head, "lm_head"))
        return out

    def _full(self, role: str, layer: int | None, dtype=None) -> Producer:
        return lambda emit: self._rows(emit, role, layer, dtype=dtype)

    def _attention(self, p: str, l: int) -> list[TensorSpec]:
        m, mp, r = self.m, self.mp, self.tp_rank
        hd, H = m.head_dim, m.hidden_size
        nh = m.num_heads // mp.tp_size
        kvr = mp.kv_head_range(m.num_kv_heads, r)
        qkv_rows = (nh + 2 * len(kvr)) * hd

        def qkv(emit, suffix=""):
            roles = ("q", "k", "v") if not suffix else ("q_bias", "k_bias", "v_bias")
            self._rows(emit, roles[0], l, r * nh * hd, (r + 1) * nh * hd)
            for role in roles[1:]:
                self._rows(emit, role, l, kvr.start * hd, kvr.stop * hd)

        specs = [TensorSpec(p + "attention.qkv.weight", (qkv_rows, H), self.dtype, qkv, "attention")]
        if m.qkv_bias:
            specs.append(TensorSpec(p + "attention.qkv.bias", (qkv_rows,), self.dtype,
                                    lambda emit: qkv(emit, "bias"), "attention"))
        if m.qk_norm:
            specs.append(TensorSpec(p + "attention.q_layernorm.weight", (hd,), self.dtype,
                                    self._full("q_norm", l), "norm"))
            specs.append(TensorSpec(p + "attention.k_layernorm.weight", (hd,), self.dtype,
                                    self._full("k_norm", l), "norm"))
        specs.append(TensorSpec(p + "attention.dense.weight", (H, nh * hd), self.dtype,
                                lambda emit: self._cols(emit, "o", l, r * nh * hd, (r + 1) * nh * hd),
                                "attention"))
        return specs

    def _gated_pair(self, up_role: str, gate_role: str, l: int, size: int, parts: int, part: int) -> Producer:
        """[up_r; gate_r] rows, the fused swiglu order (linear branch first, activated branch second)."""
        per = size // parts

        def produce(emit):
            self._rows(emit, up_role, l, part * per, (part + 1) * per)
            self._rows(emit, gate_role, l, part * per, (part + 1) * per)
        return produce

    def expert_shard(self, l: int, e: int, t: int, I_loc: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Original expert ``e``'s moe_tp shard ``t``: fc [2·I_loc, H] = [up; gate], proj [H, I_loc]."""
        return self.expert_matrix(l, e, t, I_loc, "fc"), self.expert_matrix(l, e, t, I_loc, "proj")

    def expert_matrix(self, l: int, e: int, t: int, I_loc: int, mod: str) -> torch.Tensor:
        """One matrix of original expert ``e``'s moe_tp shard ``t`` in the model dtype: ``fc``
        [2·I_loc, H] = [up; gate] or ``proj`` [H, I_loc]."""
        rows = (t * I_loc, (t + 1) * I_loc)
        if mod == "fc":
            w = torch.cat([self.src.role("expert_up", l, e, rows=rows, dtype=self.dtype),
                           self.src.role("expert_gate", l, e, rows=rows, dtype=self.dtype)])
        else:
            w = self.src.role("expert_down", l, e, dtype=self.dtype)[:, rows[0]:rows[1]]
        return w

    def _moe(self, p: str, l: int) -> list[TensorSpec]:
        m, mp, plan = self.m, self.mp, self.plan
        H, I, dt = m.hidden_size, m.expert_intermediate_size, self.dtype
        slots = mp.ep_experts(m.num_experts, self.rank)
        t = mp.moe_tp_rank(self.rank)
        I_loc = I // mp.moe_tp_size
        perm = plan.perm(l, m.num_experts) if plan is not None else list(range(m.num_experts))
        orig = [perm[s] for s in slots]

        def router(emit):
            w = self.src.role("router", l).float()
            emit(w[perm] if perm != list(range(m.num_experts)) else w)

        specs = [TensorSpec(p + "mlp.router.weight", (m.num_experts, H), torch.float32, router, "router")]
        kind = "float" if plan is None else ("expert" if plan.per_expert_layout else plan.layer_format(l))
        if kind == "expert":
            specs.extend(self._per_expert(p, l, slots, orig, t, I_loc))
        elif packed_at_conversion(kind):
            specs.extend(self._stacked_packed(p, l, orig, t, I_loc, kind))
        else:
            # Float weights; for W8A16/W4A16 layers trtllm-build quantizes them itself, for the
            # GPU it builds on (and the embedded engine quantizes them the same way at load).
            def fc(emit):
                for e in orig:
                    self._rows(emit, "expert_up", l, t * I_loc, (t + 1) * I_loc, expert=e)
                    self._rows(emit, "expert_gate", l, t * I_loc, (t + 1) * I_loc, expert=e)

            def proj(emit):
                for e in orig:
                    if mp.moe_tp_size == 1:  # the whole expert: a verbatim copy when no cast is needed
                        self._rows(emit, "expert_down", l, expert=e)
                    else:
                        self._cols(emit, "expert_down", l, t * I_loc, (t + 1) * I_loc, expert=e)

            specs.append(TensorSpec(p + "mlp.fc.weight", (len(orig), 2 * I_loc, H), dt, fc, "expert_fc"))
            specs.append(TensorSpec(p + "mlp.proj.weight", (len(orig), H, I_loc), dt, proj, "expert_proj"))
        if m.shared_expert_intermediate_size:
            S = m.shared_expert_intermediate_size
            S_loc = S // mp.tp_size
            r = self.tp_rank
            specs.append(TensorSpec(p + "mlp.shared_expert.fc.weight", (2 * S_loc, H), dt,
                                    self._gated_pair("shared_up", "shared_gate_proj", l, S, mp.tp_size, r),
                                    "shared_expert"))
            specs.append(TensorSpec(p + "mlp.shared_expert.proj.weight", (H, S_loc), dt,
                                    lambda emit: self._cols(emit, "shared_down", l, r * S_loc, (r + 1) * S_loc),
                                    "shared_expert"))
        if m.shared_expert_gate:
            specs.append(TensorSpec(p + "mlp.shared_expert_gate.weight", (1, H), dt,
                                    self._full("shared_expert_gate", l), "shared_expert_gate"))
        return specs

    def _packed_shapes(self, fmt_name: str, out_f: int, in_f: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        from ..quant.plan import format_obj

        key = (fmt_name, out_f, in_f, self.dtype)  # scales are stored in the model dtype
        if key not in _SHAPE_CACHE:
            packed = format_obj(fmt_name, self.dtype).quantize(torch.ones(out_f, in_f, dtype=self.dtype),
                                                               dtype=self.dtype)
            _SHAPE_CACHE[key] = {k: (tuple(v.shape), v.dtype) for k, v in packed.items()}
        return _SHAPE_CACHE[key]

    def _stacked_packed(self, p: str, l: int, orig: list[int], t: int, I_loc: int, fmt_name: str):
        """One format for the whole layer, stacked [E_loc, ...] per packed tensor (AWQ-style layout)."""
        from ..quant.plan import format_obj

        fmt = format_obj(fmt_name, self.dtype)
        H = self.m.hidden_size
        specs = []
        for mod, (out_f, in_f) in (("fc", (2 * I_loc, H)), ("proj", (H, I_loc))):
            for key, (shape, dtype) in self._packed_shapes(fmt_name, out_f, in_f).items():
                shared = key == "prequant_scaling_factor"  # one row shared by every expert

                def produce(emit, mod=mod, key=key, shared=shared):
                    for e in orig[:1] if shared else orig:
                        emit(fmt.quantize(self.expert_matrix(l, e, t, I_loc, mod), dtype=self.dtype)[key])

                full = shape if shared else (len(orig), *shape)
                specs.append(TensorSpec(f"{p}mlp.{mod}.{key}", full, dtype, produce, f"expert_{mod}"))
        return specs

    def _per_expert(self, p: str, l: int, slots, orig: list[int], t: int, I_loc: int):
        """trtmoe's per-expert variant (embedded engine only): every expert matrix under its own name,
        in its own format (fc and proj of one expert may differ at matrix granularity). TensorRT-LLM
        cannot build it; the config and quant_cfg.json say so."""
        from ..quant.plan import format_obj

        H = self.m.hidden_size
        specs = []
        for slot, e in zip(slots, orig):
            for mod, (out_f, in_f) in (("fc", (2 * I_loc, H)), ("proj", (H, I_loc))):
                name = self.plan.slot_matrix_format(l, slot, mod, self.m.num_experts)
                fmt = format_obj(name, self.dtype)
                for key, (shape, dtype) in self._packed_shapes(name, out_f, in_f).items():
                    def produce(emit, mod=mod, key=key, e=e, fmt=fmt):
                        emit(fmt.quantize(self.expert_matrix(l, e, t, I_loc, mod), dtype=self.dtype)[key])

                    specs.append(TensorSpec(f"{p}mlp.experts.{slot}.{mod}.{key}", shape, dtype, produce,
                                            f"expert_{mod}"))
        return specs

    def _dense(self, p: str, l: int) -> list[TensorSpec]:
        m, mp, r, dt = self.m, self.mp, self.tp_rank, self.dtype
        H, D = m.hidden_size, m.dense_intermediate_size
        D_loc = D // mp.tp_size
        a, b = r * D_loc, (r + 1) * D_loc
        # TensorRT-LLM GatedMLP names: fc = gate_proj (activated), gate = up_proj, proj = down_proj.
        return [
            TensorSpec(p + "mlp.fc.weight", (D_loc, H), dt, lambda emit: self._rows(emit, "dense_gate", l, a, b),
                       "dense_mlp"),
            TensorSpec(p + "mlp.gate.weight", (D_loc, H), dt, lambda emit: self._rows(emit, "dense_up", l, a, b),
                       "dense_mlp"),
            TensorSpec(p + "mlp.proj.weight", (H, D_loc), dt, lambda emit: self._cols(emit, "dense_down", l, a, b),
                       "dense_mlp"),
        ]


def packed_at_conversion(fmt_name: str) -> bool:
    """Layer-uniform formats whose bytes trtmoe packs itself (group-wise INT4, ModelOpt style); the
    per-channel weight-only formats stay float in the file and ``trtllm-build`` quantizes them."""
    from ..quant.formats import FORMATS, GroupInt4Format

    return isinstance(FORMATS.get(fmt_name), GroupInt4Format)


def rank_specs(m: MoEModel, mapping: Mapping, rank: int, dtype: torch.dtype, src=None,
               plan=None) -> list[TensorSpec]:
    return RankLayout(m, mapping, rank, dtype, src, plan).specs()
