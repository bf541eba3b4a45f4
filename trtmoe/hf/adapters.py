"""The architecture registry: everything trtmoe knows about one Hugging Face MoE architecture.

Per architecture (one ``Adapter``): the HF tensor name of every role, the config facts read from
``config.json``, the TensorRT-LLM architecture name and the config keys written for it (and read
back), capability fields (norm kind, router kind, shared-expert gate, dense layers), its label,
the HF model_type and the TensorRT-LLM keys its model class requires. Which TensorRT-LLM tensor is
built from which roles, in which order, sharded how and stored in which dtype is the entry's rule
table (``Adapter.rules``; by default the rules of the Llama-style ``DECODER_RULES`` whose roles the
entry names): the checkpoint layout interprets it to write rank files and the embedded engine's
loader applies it in reverse, and a table with an unknown or unused rule or role is refused when
the entry is made. Adding an architecture means adding an ``Adapter`` here (plus, for a new kind of
norm, router or attention, its kernel in the engine, and its support cells per target).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

from ..errors import CheckpointError, UnsupportedError
from ..model.description import NORM_NONE, NORM_RENORMALIZE, NORM_SPARSE_MIXER, ModelSpec
from ..model.params import role_shapes

# ---- the tensor rule table -----------------------------------------------------------------------

# Shard kinds: how a TensorRT-LLM tensor is split over ranks.
REPLICATED = "replicated"  # every rank (of the PP stage) holds all of it
TP = "tp"  # split along ``axis`` over tp; with several roles each is split, then they are concatenated
KV_HEADS = "kv_heads"  # [q; k; v]: q split over tp by heads, k and v by KV head (duplicated when fewer than tp)
VOCAB = "vocab"  # rows split over tp after zero-padding the vocabulary to a multiple of tp
MOE_TP = "moe_tp"  # routed experts: this EP rank's slots stacked, each expert split along ``axis`` over moe_tp
EP = "ep"  # one row per routed expert, in slot order (the plan's placement), on every rank

# Where a rule applies.
FIRST = "first"  # once, on the first PP stage
LAST = "last"  # once, on the last PP stage
LAYER = "layer"  # every decoder layer
MOE = "moe"  # MoE layers only
DENSE = "dense"  # dense-MLP layers only

MODEL_DTYPE = "model"
FLOAT32 = "float32"


@dataclass(frozen=True)
class Rule:
    """One TensorRT-LLM tensor: ``name`` (layer-relative for layer rules) <- HF ``roles``, concatenated
    in that order along ``axis``, sharded by ``shard``, stored in the model dtype or float32.
    ``when`` names the ``ModelSpec`` fact that must be truthy for the tensor to exist; ``tied`` is the
    role read instead of the first one when the model ties its word embeddings. ``always``: the
    architecture's TensorRT-LLM model has the tensor whatever the source says, so where the source
    lacks it (``when`` is falsy) it is written as zeros, which is exactly the source's arithmetic (an
    entry sets it on its own table through ``Adapter.always_written``)."""

    name: str
    roles: tuple[str, ...]
    shard: str
    where: str
    axis: int = 0
    dtype: str = MODEL_DTYPE
    when: str | None = None
    tied: str | None = None
    kind: str = ""  # accounting group, e.g. "expert_fc"
    always: bool = False

    def applies(self, m: ModelSpec) -> bool:
        return self.when is None or bool(getattr(m, self.when)) or self.always

    def zeros(self, m: ModelSpec) -> bool:
        """Written as zeros: the target model has the tensor, the source model does not."""
        return self.when is not None and not getattr(m, self.when) and self.always

    def source_roles(self, m: ModelSpec) -> tuple[str, ...]:
        if self.tied and m.tie_word_embeddings:
            return (self.tied, *self.roles[1:])
        return self.roles


# Llama-style decoders (every architecture below). Order = order in the rank file.
DECODER_RULES: tuple[Rule, ...] = (
    Rule("transformer.vocab_embedding.weight", ("embed",), REPLICATED, FIRST, kind="embedding"),
    Rule("input_layernorm.weight", ("input_norm",), REPLICATED, LAYER, kind="norm"),
    Rule("input_layernorm.bias", ("input_norm_bias",), REPLICATED, LAYER, when="norm_bias", kind="norm"),
    Rule("attention.qkv.weight", ("q", "k", "v"), KV_HEADS, LAYER, kind="attention"),
    Rule("attention.qkv.bias", ("q_bias", "k_bias", "v_bias"), KV_HEADS, LAYER, when="qkv_bias", kind="attention"),
    Rule("attention.q_layernorm.weight", ("q_norm",), REPLICATED, LAYER, when="qk_norm", kind="norm"),
    Rule("attention.k_layernorm.weight", ("k_norm",), REPLICATED, LAYER, when="qk_norm", kind="norm"),
    Rule("attention.dense.weight", ("o",), TP, LAYER, axis=1, kind="attention"),
    Rule("attention.dense.bias", ("o_bias",), REPLICATED, LAYER, when="attn_out_bias", kind="attention"),
    Rule("post_layernorm.weight", ("post_norm",), REPLICATED, LAYER, kind="norm"),
    Rule("post_layernorm.bias", ("post_norm_bias",), REPLICATED, LAYER, when="norm_bias", kind="norm"),
    Rule("mlp.router.weight", ("router",), EP, MOE, dtype=FLOAT32, kind="router"),
    # The fused swiglu order: linear branch (up) first, activated branch (gate) second.
    Rule("mlp.fc.weight", ("expert_up", "expert_gate"), MOE_TP, MOE, kind="expert_fc"),
    Rule("mlp.proj.weight", ("expert_down",), MOE_TP, MOE, axis=1, kind="expert_proj"),
    Rule("mlp.shared_expert.fc.weight", ("shared_up", "shared_gate_proj"), TP, MOE,
         when="shared_expert_intermediate_size", kind="shared_expert"),
    Rule("mlp.shared_expert.proj.weight", ("shared_down",), TP, MOE, axis=1,
         when="shared_expert_intermediate_size", kind="shared_expert"),
    Rule("mlp.shared_expert_gate.weight", ("shared_expert_gate",), REPLICATED, MOE, when="shared_expert_gate",
         kind="shared_expert_gate"),
    # GatedMLP names: fc = gate_proj (activated), gate = up_proj, proj = down_proj.
    Rule("mlp.fc.weight", ("dense_gate",), TP, DENSE, kind="dense_mlp"),
    Rule("mlp.gate.weight", ("dense_up",), TP, DENSE, kind="dense_mlp"),
    Rule("mlp.proj.weight", ("dense_down",), TP, DENSE, axis=1, kind="dense_mlp"),
    Rule("transformer.ln_f.weight", ("final_norm",), REPLICATED, LAST, kind="norm"),
    Rule("transformer.ln_f.bias", ("final_norm_bias",), REPLICATED, LAST, when="norm_bias", kind="norm"),
    Rule("lm_head.weight", ("lm_head",), VOCAB, LAST, tied="embed", kind="lm_head"),
    Rule("lm_head.bias", ("lm_head_bias",), VOCAB, LAST, when="lm_head_bias", kind="lm_head"),
)


def rules_of(m: ModelSpec) -> tuple[Rule, ...]:
    """The rule table of ``m``'s architecture: its registry entry's, which the checkpoint layout
    interprets and the engine's loader reverses."""
    return ADAPTERS[m.family].rules


def layer_rules(m: ModelSpec, layer: int, rules: tuple[Rule, ...] | None = None) -> list[Rule]:
    """The rules that apply to decoder layer ``layer`` of ``m``, in file order (``rules``: the
    architecture's table unless given)."""
    kinds = (LAYER, MOE if m.moe_layers[layer] else DENSE)
    return [r for r in (rules_of(m) if rules is None else rules) if r.where in kinds and r.applies(m)]


def expert_rules(m: ModelSpec, rules: tuple[Rule, ...] | None = None) -> dict[str, Rule]:
    """The routed-expert rules by the expert matrix they build: ``fc`` ([up; gate]) and ``proj`` (down),
    from ``m``'s architecture's table unless ``rules`` is given."""
    return {r.name.split(".")[-2]: r for r in (rules_of(m) if rules is None else rules) if r.shard == MOE_TP}


def global_rules(m: ModelSpec, where: str, rules: tuple[Rule, ...] | None = None) -> list[Rule]:
    return [r for r in (rules_of(m) if rules is None else rules) if r.where == where and r.applies(m)]


# ---- HF names ------------------------------------------------------------------------------------

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

# Mixtral's hub layout (also Phi-3.5-MoE's): w1 = gate, w2 = down, w3 = up.
_BLOCK_SPARSE_MOE = {
    **_COMMON,
    "router": "model.layers.{l}.block_sparse_moe.gate.weight",
    "expert_gate": "model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight",
    "expert_down": "model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight",
    "expert_up": "model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight",
}

_PHIMOE = {
    **_BLOCK_SPARSE_MOE,
    "input_norm_bias": "model.layers.{l}.input_layernorm.bias",
    "post_norm_bias": "model.layers.{l}.post_attention_layernorm.bias",
    "o_bias": "model.layers.{l}.self_attn.o_proj.bias",
    "final_norm_bias": "model.norm.bias",
    "lm_head_bias": "lm_head.bias",
}


# ---- HF config facts -----------------------------------------------------------------------------

def _first(cfg: dict, *keys, default=None):
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    return default


def _rope_params(cfg: dict) -> dict:
    # transformers 5 keeps RoPE settings in rope_parameters; older configs use rope_scaling.
    return {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}


def _rope_type(cfg: dict) -> str:
    p = _rope_params(cfg)
    return p.get("rope_type") or p.get("type") or "default"


def _rope_theta(cfg: dict, default: float = 10000.0) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(_first(params, "rope_theta", default=None) or _first(cfg, "rope_theta", default=default))


def _require(cfg: dict, key: str, *aliases):
    v = _first(cfg, key, *aliases)
    if v is None:
        raise CheckpointError(f"missing required field {key!r}", where="config.json")
    return v


def _base_facts(cfg: dict, default_norm_eps: float, default_rope_theta: float = 10000.0) -> dict:
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
        rope_theta=_rope_theta(cfg, default_rope_theta),
        norm_eps=float(_first(cfg, "rms_norm_eps", default=default_norm_eps)),
        max_position_embeddings=int(_first(cfg, "max_position_embeddings", default=4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        source_dtype=str(dtype).replace("torch.", ""),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos,
    )


def _rope_key(cfg: dict) -> str:
    """The config key that sets the RoPE type (for messages)."""
    p = cfg.get("rope_parameters") or {}
    return "rope_parameters" if (p.get("rope_type") or p.get("type")) else "rope_scaling"


def _check_rotary_fraction(params: dict) -> None:
    """Scaled RoPE in transformers rotates only ``partial_rotary_factor`` of each head (the model
    classes' unscaled RoPE ignores the key); trtmoe rotates whole heads."""
    frac = params.get("partial_rotary_factor")
    if frac is not None and float(frac) != 1.0:
        raise UnsupportedError(f"partial_rotary_factor={frac} is not supported", where="config.json",
                               hint="RoPE is converted over the whole head dimension only")


def _unscaled_rope(cfg: dict) -> dict:
    rope_type = _rope_type(cfg)
    if rope_type != "default":
        raise UnsupportedError(
            f"{_rope_key(cfg)} type {rope_type!r} (RoPE scaling) is not supported", where="config.json",
            hint="only unscaled RoPE ('default') is converted for this architecture")
    return {}


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
        **_unscaled_rope(cfg),
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
        **_unscaled_rope(cfg),
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
    top_k = int(_require(cfg, "num_experts_per_tok"))
    return dict(
        num_experts=int(_require(cfg, "n_routed_experts")),
        top_k=top_k,
        expert_intermediate_size=moe_i,
        # DeepSeek-MoE renormalises the top-k weights only when there are several (a single pick
        # keeps its softmax probability).
        normalization_mode=NORM_RENORMALIZE if cfg.get("norm_topk_prob") and top_k > 1 else NORM_NONE,
        moe_layers=tuple(l >= k_dense and l % freq == 0 for l in range(n)),
        dense_intermediate_size=int(_require(cfg, "intermediate_size")),
        shared_expert_intermediate_size=shared * moe_i,
        **_unscaled_rope(cfg),
    )


def _longrope(cfg: dict, head_dim: int) -> dict | None:
    """Phi-3 LongRoPE: per-frequency divisors for short and long contexts and their cos/sin scales."""
    if _rope_type(cfg) == "default":
        return None
    p = _rope_params(cfg)
    if _rope_type(cfg) != "longrope":
        raise UnsupportedError(f"{_rope_key(cfg)} type {_rope_type(cfg)!r} (RoPE scaling) is not supported",
                               where="config.json", hint="Phi-3.5-MoE converts with 'longrope' or unscaled RoPE")
    _check_rotary_fraction(p)
    short, long_ = p.get("short_factor"), p.get("long_factor")
    orig = _first(p, "original_max_position_embeddings", default=None) or cfg.get("original_max_position_embeddings")
    if not short or not long_ or orig is None or len(short) != head_dim // 2 or len(long_) != head_dim // 2:
        raise CheckpointError(f"longrope needs short_factor and long_factor of {head_dim // 2} values each and "
                              "original_max_position_embeddings", where="config.json")
    scale = float(cfg.get("max_position_embeddings", orig)) / float(orig)
    default_mscale = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(orig))
    return {"short_factor": [float(x) for x in short], "long_factor": [float(x) for x in long_],
            "short_mscale": float(_first(p, "short_mscale", default=default_mscale)),
            "long_mscale": float(_first(p, "long_mscale", default=default_mscale)),
            "original_max_position_embeddings": int(orig)}


def _phimoe(cfg: dict) -> dict:
    _check_act(cfg)
    n = int(_require(cfg, "num_hidden_layers"))
    heads = int(_require(cfg, "num_attention_heads"))
    head_dim = int(_first(cfg, "head_dim", default=0) or int(_require(cfg, "hidden_size")) // heads)
    top_k = int(_require(cfg, "num_experts_per_tok"))
    if top_k != 2:
        raise UnsupportedError(f"Phi-3.5-MoE's sparse-mixer routing is defined for top-2, got "
                               f"num_experts_per_tok={top_k}", where="config.json")
    window = cfg.get("sliding_window")
    max_pos = int(_first(cfg, "max_position_embeddings", default=4096))
    if window is not None and int(window) < max_pos:
        raise UnsupportedError(f"sliding_window={window} < max_position_embeddings={max_pos} is not supported",
                               where="config.json", hint="only full causal attention")
    bias = bool(cfg.get("attention_bias", False))
    return dict(
        num_experts=int(_require(cfg, "num_local_experts")),
        top_k=top_k,
        expert_intermediate_size=int(_require(cfg, "intermediate_size")),
        normalization_mode=NORM_SPARSE_MIXER,
        sparse_mixer_epsilon=float(_first(cfg, "router_jitter_noise", default=0.01)),
        moe_layers=(True,) * n,
        norm_kind="layer",
        norm_bias=True,
        qkv_bias=bias,
        attn_out_bias=bias,
        lm_head_bias=bool(cfg.get("lm_head_bias", False)),
        longrope=_longrope(cfg, head_dim),
    )


# ---- TensorRT-LLM config facts -------------------------------------------------------------------

def _mixtral_trtllm(m: ModelSpec) -> dict:
    return {"intermediate_size": m.expert_intermediate_size}


def _qwen_trtllm(m: ModelSpec) -> dict:
    return {
        "intermediate_size": m.dense_intermediate_size or m.expert_intermediate_size,
        "moe_intermediate_size": m.expert_intermediate_size,
        "qwen_type": m.family,
        "moe_shared_expert_intermediate_size": m.shared_expert_intermediate_size,
        "qk_layernorm": m.qk_norm,
        "seq_length": m.max_position_embeddings,
        "use_logn_attn": False,
        # Stored for completeness; TensorRT-LLM's QWen model makes every layer MoE, which
        # `trtmoe build --backend tensorrt-llm` checks before building.
        "mlp_only_layers": [l for l, moe_l in enumerate(m.moe_layers) if not moe_l],
        "decoder_sparse_step": 1,
    }


def _deepseek_trtllm(m: ModelSpec) -> dict:
    return {"intermediate_size": m.dense_intermediate_size or m.expert_intermediate_size,
            "moe_intermediate_size": m.expert_intermediate_size}


def _phimoe_trtllm(m: ModelSpec) -> dict:
    # TensorRT-LLM's Phi-3 decoder layer reads rotary_pct itself (no default); RoPE rotates whole heads.
    out = {"intermediate_size": m.expert_intermediate_size, "rotary_pct": 1.0}
    if m.longrope is not None:
        lr = m.longrope
        out.update(position_embedding_type="long_rope",
                   original_max_position_embeddings=lr["original_max_position_embeddings"],
                   longrope_scaling_short_factors=lr["short_factor"], longrope_scaling_long_factors=lr["long_factor"],
                   longrope_short_mscale=lr["short_mscale"], longrope_long_mscale=lr["long_mscale"])
    return out


def _moe_layers_from_mlp_only(raw: dict, n: int) -> list[bool]:
    dense = set(raw.get("mlp_only_layers") or [])
    return [l not in dense for l in range(n)]


def _phimoe_from_trtllm(raw: dict) -> dict:
    out = {"norm_kind": "layer", "norm_bias": True, "attn_out_bias": bool(raw.get("attn_bias")), "lm_head_bias": True}
    if raw.get("position_embedding_type") == "long_rope":
        out["longrope"] = {"short_factor": list(raw["longrope_scaling_short_factors"]),
                           "long_factor": list(raw["longrope_scaling_long_factors"]),
                           "short_mscale": float(raw["longrope_short_mscale"]),
                           "long_mscale": float(raw["longrope_long_mscale"]),
                           "original_max_position_embeddings": int(raw["original_max_position_embeddings"])}
    return out


# ---- the registry --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Adapter:
    """One architecture. ``facts`` reads the HF config facts that differ from the common ones;
    ``trtllm_facts`` gives the architecture's own TensorRT-LLM config keys and ``from_trtllm`` the
    model facts read back from them (beyond the common ones)."""

    family: str
    hf_architectures: tuple[str, ...]
    trtllm_architecture: str
    names: dict[str, str]
    facts: Callable[[dict], dict]
    trtllm_facts: Callable[[ModelSpec], dict]
    from_trtllm: Callable[[dict], dict] = field(default=lambda raw: {})
    default_norm_eps: float = 1e-6
    # RoPE base when config.json gives none: the model class's default (Mixtral and Phi-3.5-MoE 1e6).
    default_rope_theta: float = 10000.0
    dense_layers: bool = True  # may have dense-MLP layers (intermediate_size is their FFN size)
    shared_expert_gate: bool = False  # sigmoid gate on the shared expert's output
    # Which layers TensorRT-LLM's checkpoint loader treats as MoE, from config.json alone.
    trtllm_moe_layers: Callable[[dict, int], list[bool]] = _moe_layers_from_mlp_only
    # The rule table (None: the Llama-style table's rules whose roles this entry names). Checked when
    # the entry is made: every role a rule reads is named here, every named role is read by a rule.
    rules: tuple[Rule, ...] | None = None
    label: str = ""  # the short name tables and messages use ("Phi-3.5-MoE")
    # The model_type Hugging Face writes beside each of hf_architectures (None: family).
    hf_model_type: str | None = None
    # config.json's use_sliding_window switches the window on (Qwen MoE); else a given window applies.
    use_sliding_window_key: bool = False
    # Top-level TensorRT-LLM 1.x config keys its model class reads with no default (trtllm-build fails
    # with AttributeError without them; checkpoint.schema checks them).
    trtllm_required_keys: tuple[str, ...] = ()
    # Optional tensors (rules with a ``when``) the TensorRT-LLM model has whatever the source says:
    # written as zeros where the source lacks them (the default table's rules of these names get
    # ``always``).
    always_written: tuple[str, ...] = ()

    def __post_init__(self):
        if self.rules is None:
            named = set(self.names)
            object.__setattr__(self, "rules", tuple(
                dataclasses.replace(r, always=True) if r.name in self.always_written else r
                for r in DECODER_RULES if set(r.roles) <= named))
        optional = {r.name for r in self.rules if r.when is not None}
        unknown = sorted(set(self.always_written) - optional)
        if unknown:
            raise UnsupportedError(f"always_written names {', '.join(unknown)}, which is no optional rule of the "
                                   f"table", where=f"architecture registry: {self.family}")
        if self.hf_model_type is None:
            object.__setattr__(self, "hf_model_type", self.family)
        check_rules(self.family, self.names, self.rules)

    def name(self, role: str, layer: int | None = None, expert: int | None = None) -> str:
        return self.names[role].format(l=layer, e=expert)


_SHARDS = (REPLICATED, TP, KV_HEADS, VOCAB, MOE_TP, EP)
_WHERE = (FIRST, LAST, LAYER, MOE, DENSE)
_SPEC_FIELDS = frozenset(ModelSpec.__dataclass_fields__)


def check_rules(family: str, names: dict[str, str], rules: tuple[Rule, ...]) -> None:
    """Raise ``UnsupportedError`` naming the rule or role when a rule table cannot be interpreted: a
    rule of an unknown shard kind, place, dtype or condition, a rule reading a role the architecture
    does not name (unknown), a named role no rule reads (unused: its tensors would be dropped
    silently), or routed-expert rules other than one ``fc`` and one ``proj``."""
    where = f"architecture registry: {family}"
    read: set[str] = set()
    for r in rules:
        bad = ([f"shard kind {r.shard!r}"] * (r.shard not in _SHARDS) + [f"place {r.where!r}"] * (r.where not in _WHERE)
               + [f"dtype {r.dtype!r}"] * (r.dtype not in (MODEL_DTYPE, FLOAT32))
               + [f"condition {r.when!r}"] * (r.when is not None and r.when not in _SPEC_FIELDS))
        if bad:
            raise UnsupportedError(f"rule {r.name!r} has an unknown " + ", ".join(bad), where=where)
        unknown = [role for role in (*r.roles, *((r.tied,) if r.tied else ())) if role not in names]
        if unknown:
            raise UnsupportedError(f"rule {r.name!r} reads role(s) {', '.join(unknown)} that {family} does not name",
                                   where=where, hint="add the HF tensor name of each role to the entry's names")
        read.update(r.roles)
    unused = sorted(set(names) - read)
    if unused:
        raise UnsupportedError(f"no rule reads role(s) {', '.join(unused)}: their tensors would not be written",
                               where=where, hint="add the rule that builds a TensorRT-LLM tensor from each")
    experts = sorted(r.name.split(".")[-2] for r in rules if r.shard == MOE_TP)
    if experts != ["fc", "proj"]:
        raise UnsupportedError(f"routed-expert rules build {experts or 'nothing'}; exactly one fc and one proj "
                               f"are needed", where=where)


# QWenConfig takes qwen_type, seq_length and both MoE sizes as required arguments.
_QWEN_REQUIRED = ("qwen_type", "seq_length", "moe_intermediate_size", "moe_shared_expert_intermediate_size")

ADAPTERS: dict[str, Adapter] = {
    a.family: a
    for a in (
        Adapter("mixtral", ("MixtralForCausalLM",), "MixtralForCausalLM", _BLOCK_SPARSE_MOE, _mixtral,
                _mixtral_trtllm, default_norm_eps=1e-5, default_rope_theta=1e6, dense_layers=False, label="Mixtral"),
        Adapter("qwen2_moe", ("Qwen2MoeForCausalLM",), "Qwen2MoeForCausalLM", {
            **_QWEN_MOE,
            "shared_gate_proj": "model.layers.{l}.mlp.shared_expert.gate_proj.weight",
            "shared_up": "model.layers.{l}.mlp.shared_expert.up_proj.weight",
            "shared_down": "model.layers.{l}.mlp.shared_expert.down_proj.weight",
            "shared_expert_gate": "model.layers.{l}.mlp.shared_expert_gate.weight",
        }, _qwen2_moe, _qwen_trtllm, shared_expert_gate=True, label="Qwen2-MoE", use_sliding_window_key=True,
            trtllm_required_keys=_QWEN_REQUIRED),
        Adapter("qwen3_moe", ("Qwen3MoeForCausalLM",), "Qwen3MoeForCausalLM", _QWEN_MOE, _qwen3_moe, _qwen_trtllm,
                label="Qwen3-MoE", use_sliding_window_key=True, trtllm_required_keys=_QWEN_REQUIRED),
        Adapter("deepseek_v1", ("DeepseekForCausalLM",), "DeepseekForCausalLM", {
            **_QWEN_MOE,
            "shared_gate_proj": "model.layers.{l}.mlp.shared_experts.gate_proj.weight",
            "shared_up": "model.layers.{l}.mlp.shared_experts.up_proj.weight",
            "shared_down": "model.layers.{l}.mlp.shared_experts.down_proj.weight",
        }, _deepseek_v1, _deepseek_trtllm,
            # TensorRT-LLM's DeepSeek-V1 makes layer 0 dense and every other layer MoE.
            trtllm_moe_layers=lambda raw, n: [l > 0 for l in range(n)], label="DeepSeek-MoE v1",
            hf_model_type="deepseek",
            # DeepseekDecoderLayer reads moe_intermediate_size and DeepSeekV1Config asserts a moe block.
            trtllm_required_keys=("moe", "moe_intermediate_size")),
        # Phi-3.5-MoE: transformers 5 names the class PhimoeForCausalLM, the hub's remote code
        # PhiMoEForCausalLM (also TensorRT-LLM's name, which its phi3 model family builds).
        Adapter("phimoe", ("PhimoeForCausalLM", "PhiMoEForCausalLM"), "PhiMoEForCausalLM", _PHIMOE, _phimoe,
                _phimoe_trtllm, _phimoe_from_trtllm, default_norm_eps=1e-5, default_rope_theta=1e6,
                dense_layers=False, label="Phi-3.5-MoE",
                # TensorRT-LLM's PhiMoE always has attention (qkv and dense) and lm_head biases.
                always_written=("attention.qkv.bias", "attention.dense.bias", "lm_head.bias"),
                # Phi3DecoderLayer passes config.rotary_pct to its attention (PretrainedConfig only reads
                # the key to derive rotary_embedding_dim).
                trtllm_required_keys=("rotary_pct",)),
    )
}

_BY_ARCH = {arch: a for a in ADAPTERS.values() for arch in a.hf_architectures}
_BY_TRTLLM = {a.trtllm_architecture: a for a in ADAPTERS.values()}


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCH)


# The model_type Hugging Face writes beside each architecture trtmoe reads (what transformers itself
# goes by when a config names no architecture), from the registry entries.
HF_MODEL_TYPES = {arch: a.hf_model_type for arch, a in _BY_ARCH.items()}


def adapter_for(hf_config: dict) -> Adapter:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in _BY_ARCH:
            return _BY_ARCH[arch]
    if not archs:  # no architectures: the model_type names the model, as for transformers' AutoConfig
        mtype = hf_config.get("model_type")
        for arch, t in HF_MODEL_TYPES.items():
            if t == mtype and arch in _BY_ARCH:
                return _BY_ARCH[arch]
        raise UnsupportedError(f"no architectures given, and model_type {mtype!r} is not one trtmoe reads", where="config.json",
                               hint="supported model_type: " + ", ".join(sorted(set(HF_MODEL_TYPES.values()))))
    raise UnsupportedError(
        f"architecture {archs[0] if archs else '(none given)'!r} is not supported",
        where="config.json",
        hint="supported: " + ", ".join(supported_architectures()))


def adapter_for_checkpoint(raw: dict) -> Adapter | None:
    """The adapter of a TensorRT-LLM checkpoint ``config.json`` (trtmoe's own record first)."""
    family = (raw.get("trtmoe") or {}).get("family")
    if family in ADAPTERS:
        return ADAPTERS[family]
    return _BY_TRTLLM.get(raw.get("architecture"))


def describe(hf_config: dict) -> tuple[Adapter, ModelSpec]:
    """Build the architecture-neutral description from an HF ``config.json`` dict."""
    adapter = adapter_for(hf_config)
    facts = {**_base_facts(hf_config, adapter.default_norm_eps, adapter.default_rope_theta),
             **adapter.facts(hf_config)}
    facts.setdefault("shared_expert_gate", adapter.shared_expert_gate)
    model = ModelSpec(family=adapter.family, hf_architecture=adapter.hf_architectures[0], **facts)
    if model.top_k < 1 or model.top_k > model.num_experts:
        raise CheckpointError(f"num_experts_per_tok={model.top_k} must be in 1..{model.num_experts}",
                              where="config.json")
    return adapter, model


def expected_tensors(adapter: Adapter, m: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the model must have, with its expected shape."""
    out = {}
    for role, shape in role_shapes(m, None).items():
        if role != "lm_head" or not m.tie_word_embeddings:
            out[adapter.name(role)] = shape
    for l in range(m.num_layers):
        for role, shape in role_shapes(m, l).items():
            if role.startswith("expert_"):
                for e in range(m.num_experts):
                    out[adapter.name(role, l, e)] = shape
            else:
                out[adapter.name(role, l)] = shape
    return out
