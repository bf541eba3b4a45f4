"""Declarative architecture adapters: Hugging Face tensor names -> canonical roles, plus config facts.

Adding an architecture means adding one ``Adapter`` entry: a name table and a function that reads
the few config facts that differ. Nothing else in the project knows HF names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import CheckpointError, UnsupportedError
from ..model.description import NORM_NONE, NORM_RENORMALIZE, MoEModel

# Names shared by every Llama-style decoder we support. {l} = layer index, {e} = expert index.
_COMMON = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "input_norm": "model.layers.{l}.input_layernorm.weight",
    "post_norm": "model.layers.{l}.post_attention_layernorm.weight",
    "q": "model.layers.{l}.self_attn.q_proj.weight",
    "k": "model.layers.{l}.self_attn.k_proj.weight",
    "v": "model.layers.{l}.self_attn.v_proj.weight",
    "o": "model.layers.{l}.self_attn.o_proj.weight",
    "q_bias": "model.layers.{l}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{l}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{l}.self_attn.v_proj.bias",
    "q_norm": "model.layers.{l}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{l}.self_attn.k_norm.weight",
    "dense_gate": "model.layers.{l}.mlp.gate_proj.weight",
    "dense_up": "model.layers.{l}.mlp.up_proj.weight",
    "dense_down": "model.layers.{l}.mlp.down_proj.weight",
}

_QWEN_MOE = {
    **_COMMON,
    "router": "model.layers.{l}.mlp.gate.weight",
    "expert_gate": "model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
    "expert_up": "model.layers.{l}.mlp.experts.{e}.up_proj.weight",
    "expert_down": "model.layers.{l}.mlp.experts.{e}.down_proj.weight",
}

# Roles, grouped by where they occur; the reader uses this to know which names to expect.
GLOBAL_ROLES = ("embed", "final_norm", "lm_head")
ATTN_ROLES = ("input_norm", "post_norm", "q", "k", "v", "o")
QKV_BIAS_ROLES = ("q_bias", "k_bias", "v_bias")
QK_NORM_ROLES = ("q_norm", "k_norm")
ROUTER_ROLES = ("router",)
EXPERT_ROLES = ("expert_gate", "expert_up", "expert_down")
SHARED_ROLES = ("shared_gate_proj", "shared_up", "shared_down")
SHARED_GATE_ROLES = ("shared_expert_gate",)
DENSE_ROLES = ("dense_gate", "dense_up", "dense_down")


def _first(cfg: dict, *keys, default=None):
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return default


def _rope_theta(cfg: dict) -> float:
    # transformers 5 moved rope_theta into rope_parameters; older configs keep it top level.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise UnsupportedError(
            f"RoPE scaling type {rope_type!r} is not supported", where="config.json",
            hint="only unscaled RoPE ('default') is converted")
    return float(_first(params, "rope_theta", default=None) or _first(cfg, "rope_theta", default=10000.0))


def _require(cfg: dict, key: str, *aliases):
    v = _first(cfg, key, *aliases)
    if v is None:
        raise CheckpointError(f"missing required field {key!r}", where="config.json")
    return v


def _base_facts(cfg: dict) -> dict:
    hidden = int(_require(cfg, "hidden_size"))
    heads = int(_require(cfg, "num_attention_heads"))
    head_dim = _first(cfg, "head_dim")
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    dtype = _first(cfg, "dtype", "torch_dtype", default="float32")
    return dict(
        vocab_size=int(_require(cfg, "vocab_size")),
        hidden_size=hidden,
        num_layers=int(_require(cfg, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(_first(cfg, "num_key_value_heads", default=heads)),
        head_dim=int(head_dim) if head_dim else hidden // heads,
        rope_theta=_rope_theta(cfg),
        norm_eps=float(_first(cfg, "rms_norm_eps", default=1e-6)),
        max_position_embeddings=int(_first(cfg, "max_position_embeddings", default=4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        source_dtype=str(dtype).replace("torch.", ""),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos,
    )


def _check_act(cfg: dict):
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedError(f"hidden_act {act!r} is not supported (MoE experts must be SiLU-gated)",
                               where="config.json")


def _mixtral(cfg: dict) -> dict:
    _check_act(cfg)
    n = int(_require(cfg, "num_hidden_layers"))
    return dict(
        num_experts=int(_require(cfg, "num_local_experts", "num_experts")),
        top_k=int(_require(cfg, "num_experts_per_tok")),
        expert_intermediate_size=int(_require(cfg, "intermediate_size")),
        normalization_mode=NORM_RENORMALIZE,
        moe_layers=(True,) * n,
    )


def _qwen_moe_layers(cfg: dict, n: int) -> tuple[bool, ...]:
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    only_mlp = set(cfg.get("mlp_only_layers") or [])
    # Same rule as the HF Qwen MoE decoder layer: sparse when not listed and (l+1) % step == 0.
    return tuple((l not in only_mlp) and ((l + 1) % step == 0) for l in range(n))


def _qwen_moe(cfg: dict) -> dict:
    """Facts every Qwen MoE generation shares."""
    _check_act(cfg)
    n = int(_require(cfg, "num_hidden_layers"))
    return dict(
        num_experts=int(_require(cfg, "num_experts", "num_local_experts")),
        top_k=int(_require(cfg, "num_experts_per_tok")),
        expert_intermediate_size=int(_require(cfg, "moe_intermediate_size")),
        normalization_mode=NORM_RENORMALIZE if cfg.get("norm_topk_prob") else NORM_NONE,
        moe_layers=_qwen_moe_layers(cfg, n),
        dense_intermediate_size=int(_first(cfg, "intermediate_size", default=0)),
    )


def _qwen2_moe(cfg: dict) -> dict:
    return dict(_qwen_moe(cfg),
                shared_expert_intermediate_size=int(_require(cfg, "shared_expert_intermediate_size")),
                shared_expert_gate=True, qkv_bias=bool(cfg.get("qkv_bias", True)))


def _qwen3_moe(cfg: dict) -> dict:
    if cfg.get("attention_bias"):
        raise UnsupportedError("Qwen3-MoE with attention_bias=true is not supported", where="config.json")
    return dict(_qwen_moe(cfg), qk_norm=True)


def _deepseek_v1(cfg: dict) -> dict:
    _check_act(cfg)
    n = int(_require(cfg, "num_hidden_layers"))
    if cfg.get("scoring_func", "softmax") != "softmax":
        raise UnsupportedError(f"DeepSeek scoring_func {cfg.get('scoring_func')!r} is not supported",
                               where="config.json", hint="only softmax routing")
    if cfg.get("attention_bias"):
        raise UnsupportedError("DeepSeek with attention_bias=true is not supported", where="config.json")
    k_dense = int(cfg.get("first_k_dense_replace", 0) or 0)
    freq = int(cfg.get("moe_layer_freq", 1) or 1)
    shared = int(cfg.get("n_shared_experts") or 0)
    moe_i = int(_require(cfg, "moe_intermediate_size"))
    return dict(
        num_experts=int(_require(cfg, "n_routed_experts")),
        top_k=int(_require(cfg, "num_experts_per_tok")),
        expert_intermediate_size=moe_i,
        normalization_mode=NORM_RENORMALIZE if cfg.get("norm_topk_prob") else NORM_NONE,
        moe_layers=tuple(l >= k_dense and l % freq == 0 for l in range(n)),
        dense_intermediate_size=int(_require(cfg, "intermediate_size")),
        shared_expert_intermediate_size=shared * moe_i,
    )


@dataclass(frozen=True)
class Adapter:
    family: str
    hf_architectures: tuple[str, ...]
    trtllm_architecture: str
    names: dict[str, str]
    facts: Callable[[dict], dict]

    def name(self, role: str, layer: int | None = None, expert: int | None = None) -> str:
        return self.names[role].format(l=layer, e=expert)


ADAPTERS: dict[str, Adapter] = {
    a.family: a
    for a in (
        Adapter("mixtral", ("MixtralForCausalLM",), "MixtralForCausalLM", {
            **_COMMON,
            "router": "model.layers.{l}.block_sparse_moe.gate.weight",
            "expert_gate": "model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight",
            "expert_down": "model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight",
            "expert_up": "model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight",
        }, _mixtral),
        Adapter("qwen2_moe", ("Qwen2MoeForCausalLM",), "Qwen2MoeForCausalLM", {
            **_QWEN_MOE,
            "shared_gate_proj": "model.layers.{l}.mlp.shared_expert.gate_proj.weight",
            "shared_up": "model.layers.{l}.mlp.shared_expert.up_proj.weight",
            "shared_down": "model.layers.{l}.mlp.shared_expert.down_proj.weight",
            "shared_expert_gate": "model.layers.{l}.mlp.shared_expert_gate.weight",
        }, _qwen2_moe),
        Adapter("qwen3_moe", ("Qwen3MoeForCausalLM",), "Qwen3MoeForCausalLM", _QWEN_MOE, _qwen3_moe),
        Adapter("deepseek_v1", ("DeepseekForCausalLM",), "DeepseekForCausalLM", {
            **_QWEN_MOE,
            "shared_gate_proj": "model.layers.{l}.mlp.shared_experts.gate_proj.weight",
            "shared_up": "model.layers.{l}.mlp.shared_experts.up_proj.weight",
            "shared_down": "model.layers.{l}.mlp.shared_experts.down_proj.weight",
        }, _deepseek_v1),
    )
}

_BY_ARCH = {arch: a for a in ADAPTERS.values() for arch in a.hf_architectures}


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCH)


def adapter_for(hf_config: dict) -> Adapter:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in _BY_ARCH:
            return _BY_ARCH[arch]
    raise UnsupportedError(
        f"architecture {archs[0] if archs else '(none given)'!r} is not supported",
        where="config.json",
        hint="supported: " + ", ".join(supported_architectures()))


def describe(hf_config: dict) -> tuple[Adapter, MoEModel]:
    """Build the architecture-neutral description from an HF ``config.json`` dict."""
    adapter = adapter_for(hf_config)
    facts = {**_base_facts(hf_config), **adapter.facts(hf_config)}
    model = MoEModel(family=adapter.family, hf_architecture=adapter.hf_architectures[0], **facts)
    if model.top_k < 1 or model.top_k > model.num_experts:
        raise CheckpointError(f"num_experts_per_tok={model.top_k} must be in 1..{model.num_experts}",
                              where="config.json")
    return adapter, model


def expected_tensors(adapter: Adapter, m: MoEModel) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the model must have, with its expected shape."""
    H, I, E = m.hidden_size, m.expert_intermediate_size, m.num_experts
    out: dict[str, tuple[int, ...]] = {adapter.name("embed"): (m.vocab_size, H),
                                       adapter.name("final_norm"): (H,)}
    if not m.tie_word_embeddings:
        out[adapter.name("lm_head")] = (m.vocab_size, H)
    for l in range(m.num_layers):
        shapes = {"input_norm": (H,), "post_norm": (H,), "q": (m.q_size, H), "k": (m.kv_size, H),
                  "v": (m.kv_size, H), "o": (H, m.q_size)}
        if m.qkv_bias:
            shapes.update(q_bias=(m.q_size,), k_bias=(m.kv_size,), v_bias=(m.kv_size,))
        if m.qk_norm:
            shapes.update(q_norm=(m.head_dim,), k_norm=(m.head_dim,))
        if m.moe_layers[l]:
            shapes["router"] = (E, H)
            if m.shared_expert_intermediate_size:
                S = m.shared_expert_intermediate_size
                shapes.update(shared_gate_proj=(S, H), shared_up=(S, H), shared_down=(H, S))
            if m.shared_expert_gate:
                shapes["shared_expert_gate"] = (1, H)
            for e in range(E):
                out[adapter.name("expert_gate", l, e)] = (I, H)
                out[adapter.name("expert_up", l, e)] = (I, H)
                out[adapter.name("expert_down", l, e)] = (H, I)
        else:
            D = m.dense_intermediate_size
            shapes.update(dense_gate=(D, H), dense_up=(D, H), dense_down=(H, D))
        for role, shape in shapes.items():
            out[adapter.name(role, l)] = shape
    return out
