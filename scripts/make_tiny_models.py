#!/usr/bin/env python3
"""Seeded tiny random Hugging Face MoE checkpoints for tests and demos.

Every fixture is a real HF directory (``config.json`` + safetensors) small enough to build in
well under a second on a CPU, with shapes chosen so that all parallel layouts trtmoe supports can
split it: tp=1; tp=2 with moe_ep=2; tp=4 with moe_tp=2 x moe_ep=2; pp=2.

* 4 query heads and 2 KV heads (tp=4 has to duplicate KV heads), head_dim 16, hidden 64;
* an even number of experts, expert FFN 48 (splits in 2), dense/shared FFN 96 or 128 (split in 4);
* vocab 250, which is not a multiple of 4, so the lm_head/embedding need padding under tp=4;
* 3 or 4 layers, so pp=2 splits some fixtures unevenly.

``mixtral``, ``qwen2_moe`` and ``qwen3_moe`` are built with transformers' own classes and written
with ``save_pretrained``.  transformers 5.x keeps experts fused in memory (``experts.gate_up_proj``
of shape [E, 2I, H]) but writes the classic per-expert tensor names, which is what hub checkpoints
carry.  ``deepseek_v1`` (DeepSeek-MoE, ``DeepseekForCausalLM``) has no class in transformers, so its
config and tensors are written here directly in the hub layout.

Usage::

    python scripts/make_tiny_models.py qwen2_moe /tmp/tiny-qwen2 --dtype bfloat16 --sharded
    python scripts/make_tiny_models.py deepseek_v1 /tmp/tiny-ds --tied --seed 3
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v1", "phimoe")
# MoEs transformers implements and the embedded engine does not: calibrated through transformers'
# own modelling code (``calibrate --runner stream``), converted by the unified-HF export only.
TRANSFORMERS_ONLY = ("deepseek_v2", "deepseek_v3", "gpt_oss", "olmoe", "glm4_moe", "llama4_text")
# More transformers MoEs with a ``*Experts`` module, built from transformers' auto classes by model_type:
# calibrated layer-streamed; the unified-HF export does not read them (it refuses them by name).
SEAM_ONLY = ("granitemoe", "dots1", "flex_olmo", "exaone_moe", "afmoe", "cohere2_moe", "jamba",
             "lfm2_moe", "inkling_text", "glm_moe_dsa", "deepseek_v4", "gemma4_text", "dots3_note_text", "laguna",
             "inkling2_text", "nemotron_h")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Sharded fixtures are cut at this many bytes per file so that each one spans several shards.
SHARD_BYTES = 200_000

# Shapes every architecture shares (see the module docstring for why each value).
_COMMON: dict[str, Any] = {
    "vocab_size": 250,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
}

# Per-architecture defaults; ``config_overrides`` are applied on top of these.
DEFAULT_CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": {
        **_COMMON,
        "head_dim": 16,
        "num_hidden_layers": 3,
        "num_local_experts": 4,
        "intermediate_size": 48,  # Mixtral's intermediate_size is the per-expert FFN size
        "rms_norm_eps": 1e-5,
    },
    "qwen2_moe": {
        **_COMMON,
        "head_dim": 16,
        "num_hidden_layers": 4,
        "num_experts": 8,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 96,
        "intermediate_size": 128,  # only the dense layer(s) listed in mlp_only_layers use it
        "mlp_only_layers": [2],
        "decoder_sparse_step": 1,
        "norm_topk_prob": False,
        "qkv_bias": True,
        "rms_norm_eps": 1e-6,
    },
    "qwen3_moe": {
        **_COMMON,
        "head_dim": 16,
        "num_hidden_layers": 3,
        "num_experts": 8,
        "moe_intermediate_size": 48,
        "intermediate_size": 128,
        "mlp_only_layers": [],
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
    },
    # Phi-3.5-MoE's shape: LayerNorm with bias, attention and lm_head biases, sparse-mixer top-2
    # routing, LongRoPE with distinct short and long factors.
    "phimoe": {
        **_COMMON,
        "head_dim": 16,
        "num_hidden_layers": 3,
        "num_local_experts": 4,
        "intermediate_size": 48,
        "rms_norm_eps": 1e-5,
        "attention_bias": True,
        "lm_head_bias": True,
        "router_jitter_noise": 0.01,
        "input_jitter_noise": 0.0,
        "original_max_position_embeddings": 128,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                            "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0, 2.5],
                            "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0],
                            "short_mscale": 1.1, "long_mscale": 1.2,
                            "original_max_position_embeddings": 128},
    },
    # DeepSeek-V3's shape: multi-head latent attention (q and kv LoRA ranks, a decoupled RoPE part),
    # a dense first layer, one shared expert, sigmoid routing with a correction bias, grouped top-k
    # (4 groups, the best 2 kept) and a routed scaling factor.
    "deepseek_v3": {
        **_COMMON,
        "num_key_value_heads": 4,
        "num_hidden_layers": 3,
        "intermediate_size": 128,
        "moe_intermediate_size": 48,
        "n_shared_experts": 1,
        "n_routed_experts": 8,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
    },
    # gpt-oss's shape: experts stored transposed ([E, H, 2I]) with gate/up interleaved and biases, a
    # clamped GLU, attention sinks, alternating sliding-window and full attention, a biased router.
    "gpt_oss": {
        **_COMMON,
        "head_dim": 16,
        "num_hidden_layers": 3,
        "num_local_experts": 4,
        "intermediate_size": 48,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                            "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0},
        "eos_token_id": 2, "pad_token_id": 0,
    },
    # OLMoE's shape: q/k RMSNorm over the whole projection, 8 experts top-2 without renormalisation.
    "olmoe": {
        **_COMMON,
        "num_hidden_layers": 3,
        "num_experts": 8,
        "intermediate_size": 48,
        "norm_topk_prob": False,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    },
    # DeepSeek-V2-Lite's shape: MLA without a query LoRA (q_lora_rank null), softmax greedy top-k
    # without renormalisation, two shared experts, a dense first layer.
    "deepseek_v2": {
        **_COMMON,
        "num_key_value_heads": 4,
        "num_hidden_layers": 3,
        "intermediate_size": 128,
        "moe_intermediate_size": 48,
        "n_shared_experts": 2,
        "n_routed_experts": 8,
        "routed_scaling_factor": 1.0,
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "topk_method": "greedy",
        "first_k_dense_replace": 1,
        "norm_topk_prob": False,
        "rms_norm_eps": 1e-6,
    },
    # Llama-4's text model (Maverick's interleaving): MoE every second layer, one routed expert per token
    # whose input is scaled by a sigmoid router weight, a shared expert, layers without RoPE, q/k L2 norm.
    "llama4_text": {
        **_COMMON,
        "head_dim": 16,
        "num_hidden_layers": 4,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "intermediate_size": 48,
        "intermediate_size_mlp": 128,
        "interleave_moe_layer_step": 2,
        "no_rope_layer_interval": 2,
        "attention_chunk_size": 8192,
        "use_qk_norm": True,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    },
    # GLM-4.5's shape: partial rotary (half the head), q/k/v biases, a dense first layer, sigmoid
    # grouped top-k with a correction bias and renormalised weights, one shared expert.
    "glm4_moe": {
        **_COMMON,
        "head_dim": 16,
        "num_hidden_layers": 3,
        "intermediate_size": 128,
        "moe_intermediate_size": 48,
        "n_shared_experts": 1,
        "n_routed_experts": 8,
        "routed_scaling_factor": 2.5,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "attention_bias": True,
        "use_qk_norm": True,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-5,
    },
    # Granite-MoE: experts stored fused as input_linear [E, 2I, H] / output_linear [E, H, I], a router
    # module (router.layer), muP-style multipliers.
    "granitemoe": {
        **_COMMON,
        "num_hidden_layers": 3,
        "num_local_experts": 8,
        "intermediate_size": 48,
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.25,
        "logits_scaling": 2.0,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    },
    # dots.llm1: a dense first layer, one shared expert, sigmoid routing with a correction bias, q/k norm.
    "dots1": {
        **_COMMON,
        "head_dim": 16,
        "num_hidden_layers": 3,
        "intermediate_size": 128,
        "moe_intermediate_size": 48,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.0,
        "norm_topk_prob": True,
        "sliding_window": None,
        "layer_types": ["full_attention"] * 3,
        "rms_norm_eps": 1e-6,
    },
    # FlexOlmo: post-norm layers (the norm after attention and after the MoE), q/k RMSNorm over the projection.
    "flex_olmo": {
        **_COMMON,
        "num_hidden_layers": 3,
        "num_experts": 8,
        "intermediate_size": 48,
        "norm_topk_prob": False,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    },
    # EXAONE-MoE: a dense first layer (mlp_layer_types), a shared expert, sigmoid routing with a correction
    # bias, sliding-window layers.
    "exaone_moe": {
        **_COMMON,
        "head_dim": 16,
        "num_hidden_layers": 3,
        "intermediate_size": 128,
        "moe_intermediate_size": 48,
        "num_experts": 8,
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "mlp_layer_types": ["dense", "sparse", "sparse"],
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "sliding_window": 8,
        "routed_scaling_factor": 2.5,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    },
    # AFMoE: a dense first layer, two shared experts, gated attention, pre/post MLP norms, sliding and
    # global attention layers.
    "afmoe": {
        **_COMMON,
        "head_dim": 16,
        "num_hidden_layers": 3,
        "intermediate_size": 128,
        "moe_intermediate_size": 48,
        "num_experts": 8,
        "num_shared_experts": 2,
        "num_dense_layers": 1,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "sliding_window": 8,
        "rms_norm_eps": 1e-5,
    },
    # Cohere-2-MoE: LayerNorm, parallel attention and MoE, logits multiplied by logit_scale, sliding and
    # global attention layers.
    "cohere2_moe": {
        **_COMMON,
        "head_dim": 16,
        "num_hidden_layers": 3,
        "num_experts": 8,
        "intermediate_size": 48,
        "logit_scale": 0.5,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "mlp_layer_types": ["sparse", "sparse", "sparse"],
        "sliding_window": 8,
        "layer_norm_eps": 1e-5,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    },
    # Jamba: Mamba layers with attention every second layer, experts every second layer (the others
    # dense), the final norm named final_layernorm.
    "jamba": {
        **_COMMON,
        "num_hidden_layers": 4,
        "num_experts": 8,
        "intermediate_size": 48,
        "attn_layer_period": 2, "attn_layer_offset": 1,
        "expert_layer_period": 2, "expert_layer_offset": 1,
        "mamba_d_state": 8, "mamba_dt_rank": 8,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    },
    # LFM2-MoE: short-convolution layers beside attention ones, a dense first layer, sigmoid routing with an
    # expert bias, the final norm named embedding_norm.
    "lfm2_moe": {
        **_COMMON,
        "num_hidden_layers": 3,
        "num_experts": 8,
        "intermediate_size": 128,
        "moe_intermediate_size": 48,
        "num_dense_layers": 1,
        "layer_types": ["full_attention", "conv", "full_attention"],
        "norm_eps": 1e-5,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    },
    # Inkling: an RMSNorm inside the input embedding (its output is not a bare table lookup), hybrid
    # sliding-window attention.
    "inkling_text": {
        **_COMMON,
        "head_dim": 16, "swa_head_dim": 16, "num_hidden_layers": 3, "intermediate_size": 96,
        "moe_intermediate_size": 48, "n_routed_experts": 8, "mlp_layer_types": ["sparse"] * 3,
        "layer_types": ["hybrid_sliding"] * 3, "sliding_window_size": 8, "rel_extent": 16,
    },
    # Inkling-2: the logits are formed from a mix of every layer's output (block residuals), which a
    # layer-streamed run cannot reproduce: calibration refuses it.
    "inkling2_text": {
        **_COMMON,
        "head_dim": 16, "swa_head_dim": 16, "num_hidden_layers": 3, "moe_intermediate_size": 48,
        "n_routed_experts": 8, "layer_types": ["hybrid_sliding"] * 3, "sliding_window_size": 8, "rel_extent": 16,
        "log_scaling_n_floor": 16, "unpadded_vocab_size": 250, "eos_token_id": 2,
    },
    # GLM-MoE-DSA: MLA with a sparse-attention indexer whose top-k each layer returns to the model's loop,
    # which hands it to the next layer (a layer output besides the hidden state); a dense first layer.
    "glm_moe_dsa": {
        **_COMMON,
        "num_key_value_heads": 4, "head_dim": 8, "num_hidden_layers": 3, "intermediate_size": 96,
        "moe_intermediate_size": 48, "n_routed_experts": 8, "first_k_dense_replace": 1,
        "mlp_layer_types": ["dense", "sparse", "sparse"], "layer_types": ["indexed_attention"] * 3,
        "indexer_types": ["full"] * 3, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 16,
        "kv_lora_rank": 32, "q_lora_rank": 32, "qk_head_dim": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16,
    },
    # DeepSeek-V4: hyper-connections (the hidden state between layers is [batch, tokens, copies, hidden]),
    # hash-routed MoE, compressed attention with rotary tables of its own inside each layer (computed
    # buffers no checkpoint holds).
    "deepseek_v4": {
        **_COMMON,
        "head_dim": 16, "num_hidden_layers": 3, "moe_intermediate_size": 48, "n_routed_experts": 8,
        "layer_types": ["heavily_compressed_attention"] * 3, "mlp_layer_types": ["hash_moe"] * 3,
        "qk_rope_head_dim": 2,
    },
    # Gemma-4 (text): a scaled embedding (a computed buffer), per-layer inputs, the experts beside a dense
    # MLP in every layer, experts per token named top_k_experts.
    "gemma4_text": {
        **_COMMON,
        "head_dim": 16, "num_hidden_layers": 3, "intermediate_size": 96, "moe_intermediate_size": 48,
        "num_experts": 8, "top_k_experts": 2, "enable_moe_block": True, "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": 250, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    },
    # dots.3-note: a heterogeneous config (per_layer_config: layer 2 has other head counts, so reading
    # num_attention_heads globally raises), MLA with an indexer, a dense first layer.
    "dots3_note_text": {
        **_COMMON,
        "num_key_value_heads": 4, "head_dim": 16, "num_hidden_layers": 3, "intermediate_size": 96,
        "moe_intermediate_size": 48, "n_routed_experts": 8, "shared_experts_intermediate_size": 48,
        "layer_types": ["indexed_attention", "indexed_attention", "sliding_attention"],
        "mlp_layer_types": ["dense", "sparse", "sparse"], "index_head_dim": 16, "index_n_heads": 2,
        "index_topk": 16, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "per_layer_config": {"2": {"kv_lora_rank": 16, "num_attention_heads": 2, "num_key_value_heads": 2,
                                   "qk_nope_head_dim": 8}},
        "rope_parameters": {
            "indexed_attention": {"partial_rotary_factor": 0.5, "rope_theta": 80000000.0, "rope_type": "default"},
            "sliding_attention": {"partial_rotary_factor": 0.5, "rope_theta": 50000.0, "rope_type": "default"}},
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    },
    # Laguna: a shared expert the hub names shared_expert and transformers' loader renames shared_experts,
    # a dense first layer.
    "laguna": {
        **_COMMON,
        "head_dim": 16, "num_hidden_layers": 3, "intermediate_size": 96, "moe_intermediate_size": 48,
        "num_experts": 8, "shared_expert_intermediate_size": 96, "num_attention_heads_per_layer": [4, 4, 4],
        "layer_types": ["full_attention"] * 3, "mlp_layer_types": ["dense", "sparse", "sparse"],
    },
    # Nemotron-H: Mamba-2, attention, MoE and MLP layers; experts without a gate projection (relu²).
    "nemotron_h": {
        **_COMMON,
        "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 48, "n_routed_experts": 8,
        "moe_shared_expert_intermediate_size": 96, "mamba_head_dim": 16, "mamba_num_heads": 8, "n_groups": 2,
        "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"],
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    },
    # Field set of deepseek-ai/deepseek-moe-16b-base's config.json, shrunk.
    "deepseek_v1": {
        **_COMMON,
        "architectures": ["DeepseekForCausalLM"],
        "model_type": "deepseek",
        "num_hidden_layers": 3,
        "intermediate_size": 128,  # dense MLP of the first_k_dense_replace layers
        "moe_intermediate_size": 48,
        "n_shared_experts": 2,
        "n_routed_experts": 8,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
        "aux_loss_alpha": 0.001,
        "seq_aux": True,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "bos_token_id": 1,  # the 16B model uses 100000/100001, which lie outside a 250-token vocab
        "eos_token_id": 2,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
    },
}


# ----------------------------------------------------------------------------------------------
# Seeded initialisation
# ----------------------------------------------------------------------------------------------

def _generator(seed: int, arch: str, name: str) -> torch.Generator:
    """One generator per (architecture, tensor name): values do not depend on creation order, and
    same-named tensors of different architectures differ."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + zlib.crc32(f"{arch}:{name}".encode())) % (2**63 - 1))
    return g


def init_tensor(
    arch: str, name: str, shape: tuple[int, ...] | torch.Size, seed: int
) -> torch.Tensor:
    """Draw a float32 tensor for parameter ``name`` of an ``arch`` fixture.

    Scales keep every block's output comparable to the residual stream so logits are far from
    flat and routing varies between tokens:
    norms ~ N(1, 0.1); biases ~ N(0, 0.1); embeddings ~ N(0, 0.5); routers ~ N(0, 0.2)
    (router logits of std ~1.6); lm_head std 2/sqrt(in); other linears std 1/sqrt(in).
    """
    shape = tuple(shape)
    g = _generator(seed, arch, name)
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * x
    if name.endswith(".bias"):
        return 0.1 * x
    if "embed_tokens" in name:
        return 0.5 * x
    if name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
        return 0.2 * x
    if name.startswith("lm_head"):
        return (2.0 / math.sqrt(shape[-1])) * x
    return (1.0 / math.sqrt(shape[-1])) * x


# ----------------------------------------------------------------------------------------------
# transformers-native architectures
# ----------------------------------------------------------------------------------------------

def _hf_classes(arch: str):
    import transformers

    if arch in SEAM_ONLY:
        return transformers.CONFIG_MAPPING[arch], transformers.AutoModelForCausalLM.from_config
    return {
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "phimoe": (transformers.PhimoeConfig, transformers.PhimoeForCausalLM),
        "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
        "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
        "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM),
        "llama4_text": (transformers.Llama4TextConfig, transformers.Llama4ForCausalLM),
    }[arch]


def _make_transformers_model(
    arch: str, out_dir: Path, config: dict[str, Any], dtype: torch.dtype, sharded: bool, seed: int
) -> None:
    config_cls, model_cls = _hf_classes(arch)
    hf_config = config_cls(**config)
    if arch in SEAM_ONLY:  # the auto class's config records no architecture unless told
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        hf_config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[arch]]
    model = model_cls(hf_config)
    with torch.no_grad():
        # named_parameters() yields a tied lm_head once (as the embedding), so ties stay intact.
        for name, param in model.named_parameters():
            param.copy_(init_tensor(arch, name, param.shape, seed))
        for name, buf in model.named_buffers():  # DeepSeek-V3's router correction bias: not all zero
            if name.endswith("e_score_correction_bias"):
                buf.copy_(init_tensor(arch, name.replace("e_score_correction_bias", "bias"), buf.shape, seed))
    model = model.to(dtype).eval()
    model.save_pretrained(out_dir, max_shard_size=SHARD_BYTES if sharded else "10GB")


# ----------------------------------------------------------------------------------------------
# DeepSeek-MoE v1 (no transformers class): write the hub layout directly
# ----------------------------------------------------------------------------------------------

def deepseek_v1_is_moe_layer(config: dict[str, Any], layer: int) -> bool:
    """DeepSeek-MoE's rule: routed experts from first_k_dense_replace on, every moe_layer_freq."""
    return (
        config.get("n_routed_experts") is not None
        and layer >= config["first_k_dense_replace"]
        and layer % config["moe_layer_freq"] == 0
    )


def deepseek_v1_tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes ([out, in] for linears) of a DeepSeek-MoE v1 checkpoint."""
    h = config["hidden_size"]
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = h // n_heads  # DeepSeek-MoE has no head_dim field
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], h)}

    def mlp(prefix: str, inter: int) -> None:
        shapes[f"{prefix}.gate_proj.weight"] = (inter, h)
        shapes[f"{prefix}.up_proj.weight"] = (inter, h)
        shapes[f"{prefix}.down_proj.weight"] = (h, inter)

    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        shapes[f"{p}.self_attn.q_proj.weight"] = (n_heads * head_dim, h)
        shapes[f"{p}.self_attn.k_proj.weight"] = (n_kv * head_dim, h)
        shapes[f"{p}.self_attn.v_proj.weight"] = (n_kv * head_dim, h)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, n_heads * head_dim)
        if deepseek_v1_is_moe_layer(config, layer):
            shapes[f"{p}.mlp.gate.weight"] = (config["n_routed_experts"], h)
            for e in range(config["n_routed_experts"]):
                mlp(f"{p}.mlp.experts.{e}", config["moe_intermediate_size"])
            if config.get("n_shared_experts"):
                mlp(f"{p}.mlp.shared_experts",
                    config["moe_intermediate_size"] * config["n_shared_experts"])
        else:
            mlp(f"{p}.mlp", config["intermediate_size"])
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    return shapes


def write_safetensors_dir(
    out_dir: Path, tensors: dict[str, torch.Tensor], *, shard_bytes: int | None = None
) -> list[Path]:
    """Write ``tensors`` as ``model.safetensors`` or, when ``shard_bytes`` is set, as
    ``model-0000i-of-0000N.safetensors`` shards of at most ``shard_bytes`` bytes (a larger single
    tensor gets its own shard) plus ``model.safetensors.index.json``, as HF does."""
    if shard_bytes is None:
        path = out_dir / "model.safetensors"
        save_file(tensors, str(path), metadata={"format": "pt"})
        return [path]
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and used + nbytes > shard_bytes:
            shards.append({})
            used = 0
        shards[-1][name] = t
        used += nbytes
    n = len(shards)
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        paths.append(out_dir / fname)
        weight_map.update({name: fname for name in shard})
    index = {
        "metadata": {
            "total_size": sum(t.numel() * t.element_size() for t in tensors.values()),
            "total_parameters": sum(t.numel() for t in tensors.values()),
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return paths


def _make_deepseek_v1(
    out_dir: Path, config: dict[str, Any], dtype_name: str, sharded: bool, seed: int
) -> None:
    if config.get("attention_bias"):
        raise ValueError("deepseek_v1 fixtures support attention_bias=false only")
    if config.get("scoring_func", "softmax") != "softmax":
        raise ValueError("DeepSeek-MoE v1 only defines scoring_func='softmax'")
    if config["hidden_size"] % config["num_attention_heads"]:
        raise ValueError("hidden_size must be divisible by num_attention_heads")
    config = {**config, "torch_dtype": dtype_name}
    dtype = DTYPES[dtype_name]
    tensors = {
        name: init_tensor("deepseek_v1", name, shape, seed).to(dtype).contiguous()
        for name, shape in deepseek_v1_tensor_shapes(config).items()
    }
    ordered = dict(sorted(config.items()))
    (out_dir / "config.json").write_text(json.dumps(ordered, indent=2) + "\n")
    write_safetensors_dir(out_dir, tensors, shard_bytes=SHARD_BYTES if sharded else None)


# ----------------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------------

def tiny_config(arch: str, *, tied: bool = False, **config_overrides: Any) -> dict[str, Any]:
    """The config keyword set ``make_tiny_model`` would use for ``arch`` (a fresh dict)."""
    if arch not in ARCHITECTURES + TRANSFORMERS_ONLY + SEAM_ONLY:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES + TRANSFORMERS_ONLY + SEAM_ONLY)}")
    config = json.loads(json.dumps(DEFAULT_CONFIGS[arch]))  # deep copy
    config["tie_word_embeddings"] = bool(tied)
    config.update(config_overrides)
    return config


def make_tiny_model(
    arch: str,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    sharded: bool = False,
    tied: bool = False,
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Write a seeded random tiny HF MoE checkpoint of ``arch`` into ``out_dir`` and return it.

    ``dtype`` is the storage dtype of every tensor (``float32``, ``bfloat16`` or ``float16``);
    ``sharded`` splits the weights over several ~200 kB files with an index; ``tied`` sets
    ``tie_word_embeddings`` (no ``lm_head.weight`` is written); the same ``seed`` always yields the
    same values, whatever the dtype or sharding.  ``config_overrides`` replace config fields
    (e.g. ``num_hidden_layers=4``).  ``out_dir`` must be absent or empty.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    config = tiny_config(arch, tied=tied, **config_overrides)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; pick a fresh directory")
    out.mkdir(parents=True, exist_ok=True)
    if arch == "deepseek_v1":
        _make_deepseek_v1(out, config, dtype, sharded, seed)
    else:
        _make_transformers_model(arch, out, config, DTYPES[dtype], sharded, seed)
    return out


def _tokenizer_ids(path: Path) -> int:
    """How many token ids a ``tokenizer.json`` uses: its highest id (vocabulary or added token) + 1."""
    tok = json.loads(path.read_text(encoding="utf-8"))
    vocab = (tok.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))  # BPE/WordPiece or Unigram
    ids += [t["id"] for t in tok.get("added_tokens") or []]
    if not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ValueError(f"{path.name} lists no token ids")
    return max(ids) + 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Write a seeded tiny random Hugging Face MoE checkpoint.",
        epilog="examples:\n"
               "  python scripts/make_tiny_models.py mixtral /tmp/tiny-mixtral --sharded\n"
               "  # Qwen3-30B-A3B's routing (48 layers x 128 experts, top-8) at a tiny width, with the trained\n"
               "  # fixture's tokenizer (what scripts/bench_peers.py --fixture needs):\n"
               "  python scripts/make_tiny_models.py qwen3_moe /tmp/wide48 --dtype bfloat16 --set num_hidden_layers=48 \\\n"
               "      --set num_experts=128 --set num_experts_per_tok=8 --set moe_intermediate_size=32 \\\n"
               "      --set vocab_size=2048 --tokenizer-from tests/fixtures/trained_mixtral",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("arch", choices=ARCHITECTURES + TRANSFORMERS_ONLY + SEAM_ONLY)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--sharded", action="store_true", help="several shards + index.json")
    parser.add_argument("--tied", action="store_true", help="tie_word_embeddings=true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override (repeatable; VALUE read as JSON, else as a string)")
    parser.add_argument("--tokenizer-from", type=Path, metavar="DIR",
                        help="copy tokenizer.json, tokenizer_config.json and special_tokens_map.json from DIR")
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq or not key:
            parser.exit(2, f"error: --set wants KEY=VALUE, got {item!r}\n")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    if args.tokenizer_from is not None:  # checked before anything is written
        missing = [n for n in tokenizer_files if not (args.tokenizer_from / n).is_file()]
        if missing:
            parser.exit(2, f"error: --tokenizer-from {args.tokenizer_from}: no {', '.join(missing)}\n")
        try:
            need = _tokenizer_ids(args.tokenizer_from / "tokenizer.json")
            vocab = tiny_config(args.arch, tied=args.tied, **overrides)["vocab_size"]
        except (ValueError, TypeError, KeyError, OSError) as exc:
            parser.exit(2, f"error: --tokenizer-from {args.tokenizer_from}: {exc}\n")
        if need > vocab:  # ids past the embedding would fail only once the model is served
            parser.exit(2, f"error: --tokenizer-from {args.tokenizer_from}: its tokenizer uses ids up to {need - 1}, "
                           f"beyond the model's vocab_size {vocab} (add --set vocab_size={need})\n")
    torch.set_num_threads(1)  # tiny tensors: extra threads only cost start-up time
    try:
        path = make_tiny_model(args.arch, args.out_dir, dtype=args.dtype, sharded=args.sharded,
                               tied=args.tied, seed=args.seed, **overrides)
        if args.tokenizer_from is not None:
            for name in tokenizer_files:
                shutil.copyfile(args.tokenizer_from / name, path / name)
    except (FileExistsError, ValueError, OSError, TypeError) as exc:
        parser.exit(2, f"error: {exc}\n")
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
