"""The architecture-neutral description of a MoE decoder, shared by every stage."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# TensorRT-LLM MoeConfig.normalization_mode values we produce.
NORM_NONE = 0  # topk(softmax(logits)), weights not renormalised
NORM_RENORMALIZE = 1  # softmax over the top-k logits (= top-k of softmax, renormalised)
NORM_SPARSE_MIXER = 2  # Phi-3.5-MoE's sparse mixer: each pick's weight is a softmax over the logits near it


@dataclass(frozen=True)
class ModelSpec:
    """Everything a converter, engine or planner needs to know about a MoE decoder-only model.

    Sizes are element counts; ``moe_layers[l]`` is True where layer ``l`` has routed experts and
    False where it has a dense gated MLP of ``dense_intermediate_size``.
    """

    family: str  # adapter key (trtmoe.hf.adapters.ADAPTERS): mixtral | qwen2_moe | qwen3_moe | deepseek_v1 | phimoe
    hf_architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    normalization_mode: int
    moe_layers: tuple[bool, ...]
    dense_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    attn_out_bias: bool = False  # o_proj has a bias
    norm_kind: str = "rms"  # "rms" (RMSNorm) or "layer" (LayerNorm)
    norm_bias: bool = False  # the norms have a bias (LayerNorm)
    lm_head_bias: bool = False
    sparse_mixer_epsilon: float = 0.01  # used with NORM_SPARSE_MIXER
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    source_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Phi-3 LongRoPE: short_factor, long_factor, short_mscale, long_mscale,
    # original_max_position_embeddings; None for unscaled RoPE.
    longrope: dict | None = field(default=None, compare=False)
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        d = asdict(self)
        d["moe_layers"] = list(self.moe_layers)
        return d
