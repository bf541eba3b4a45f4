"""Plain fp32 reference forward for DeepSeek-MoE v1 checkpoints in the Hugging Face layout.

transformers has no ``DeepseekForCausalLM`` (it lives as remote code on the hub, which we never
execute), so parity tests compare against this file instead.  It is written for reading, not speed:
one function per block, no KV cache, no padding masks.

The model, per decoder layer ``l``::

    h = x + o_proj(attention(rope(q_proj(rms(x))), rope(k_proj(rms(x))), v_proj(rms(x))))
    x = h + mlp_l(rms(h))

``mlp_l`` is a dense SwiGLU MLP for ``l < first_k_dense_replace`` (or ``l % moe_layer_freq != 0``);
otherwise it is the MoE block::

    p = softmax(gate(x))                       # over all n_routed_experts
    w, idx = topk(p, num_experts_per_tok)      # renormalised to sum 1 only if norm_topk_prob
    y = sum_k w_k * expert_{idx_k}(x) + shared_experts(x)     # shared experts are not gated

RoPE is the GPT-NeoX (rotate-half) form with base ``rope_theta`` over the full head dimension.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open


def load_hf_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF checkpoint directory (one file, or shards with an index), as stored."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for fname in files:
        with safe_open(str(model_dir / fname), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def rope_cos_sin(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, head_dim] for GPT-NeoX RoPE (the two halves share frequencies)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, heads, T, D]: x*cos + rotate_half(x)*sin with rotate_half = (-x2, x1)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def swiglu_mlp(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with weights ``{prefix}.{gate,up,down}_proj.weight``."""
    gate = x @ w[f"{prefix}.gate_proj.weight"].T
    up = x @ w[f"{prefix}.up_proj.weight"].T
    return (F.silu(gate) * up) @ w[f"{prefix}.down_proj.weight"].T


class DeepseekV1Reference:
    """fp32 DeepSeek-MoE v1 loaded from an HF directory.

    After each ``logits`` call, ``routed_experts[l]`` holds the LongTensor [B*T, top_k] of expert
    ids layer ``l`` selected (MoE layers only), for routing checks.
    """

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self.config = json.loads((model_dir / "config.json").read_text())
        cfg = self.config
        if cfg.get("scoring_func", "softmax") != "softmax":
            raise ValueError(f"unsupported scoring_func {cfg['scoring_func']!r}")
        if cfg.get("rope_scaling"):
            raise ValueError("rope_scaling is not supported by the reference")
        if cfg.get("attention_bias"):
            raise ValueError("attention_bias=true is not supported by the reference")
        self.w = {k: v.to(torch.float32) for k, v in load_hf_tensors(model_dir).items()}
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv_heads = cfg.get("num_key_value_heads") or self.n_heads
        self.head_dim = cfg["hidden_size"] // self.n_heads
        self.eps = cfg["rms_norm_eps"]
        self.routed_experts: dict[int, torch.Tensor] = {}

    def is_moe_layer(self, layer: int) -> bool:
        cfg = self.config
        return (
            cfg.get("n_routed_experts") is not None
            and layer >= cfg["first_k_dense_replace"]
            and layer % cfg["moe_layer_freq"] == 0
        )

    def attention(self, x: torch.Tensor, layer: int, cos: torch.Tensor, sin: torch.Tensor):
        """Causal grouped-query self-attention of ``x`` [B, T, H]."""
        p = f"model.layers.{layer}.self_attn"
        B, T, _ = x.shape
        q = (x @ self.w[f"{p}.q_proj.weight"].T).view(B, T, self.n_heads, self.head_dim)
        k = (x @ self.w[f"{p}.k_proj.weight"].T).view(B, T, self.n_kv_heads, self.head_dim)
        v = (x @ self.w[f"{p}.v_proj.weight"].T).view(B, T, self.n_kv_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # query head h reads KV head h // (n_heads / n_kv_heads)
        group = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) / self.head_dim**0.5
        future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
        out = scores.softmax(dim=-1) @ v  # [B, heads, T, D]
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return out @ self.w[f"{p}.o_proj.weight"].T

    def moe(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """Routed experts (softmax -> top-k -> optional renormalise) plus ungated shared experts."""
        cfg = self.config
        p = f"model.layers.{layer}.mlp"
        B, T, H = x.shape
        tokens = x.reshape(B * T, H)
        probs = (tokens @ self.w[f"{p}.gate.weight"].T).softmax(dim=-1)
        top_w, top_idx = torch.topk(probs, cfg["num_experts_per_tok"], dim=-1)
        if cfg["num_experts_per_tok"] > 1 and cfg.get("norm_topk_prob", False):
            top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
        self.routed_experts[layer] = top_idx
        out = torch.zeros_like(tokens)
        for e in range(cfg["n_routed_experts"]):
            token_pos, slot = (top_idx == e).nonzero(as_tuple=True)
            if token_pos.numel():
                y = swiglu_mlp(tokens[token_pos], self.w, f"{p}.experts.{e}")
                out.index_add_(0, token_pos, y * top_w[token_pos, slot, None])
        if cfg.get("n_shared_experts"):
            out = out + swiglu_mlp(tokens, self.w, f"{p}.shared_experts")
        return out.view(B, T, H)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] (float32) for ``input_ids`` [B, T] at positions 0..T-1."""
        cfg = self.config
        self.routed_experts = {}
        x = self.w["model.embed_tokens.weight"][input_ids]
        cos, sin = rope_cos_sin(input_ids.shape[1], self.head_dim, float(cfg["rope_theta"]))
        for layer in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}"
            x = x + self.attention(rms_norm(x, self.w[f"{p}.input_layernorm.weight"], self.eps),
                                   layer, cos, sin)
            h = rms_norm(x, self.w[f"{p}.post_attention_layernorm.weight"], self.eps)
            if self.is_moe_layer(layer):
                x = x + self.moe(h, layer)
            else:
                x = x + swiglu_mlp(h, self.w, f"{p}.mlp")
        x = rms_norm(x, self.w["model.norm.weight"], self.eps)
        head = self.w.get("lm_head.weight")
        if head is None or cfg.get("tie_word_embeddings", False):
            head = self.w["model.embed_tokens.weight"]
        return x @ head.T


def deepseek_v1_logits(model_dir: str | Path, input_ids: torch.Tensor) -> torch.Tensor:
    """fp32 reference logits [B, T, vocab] of the DeepSeek-MoE v1 checkpoint in ``model_dir``."""
    return DeepseekV1Reference(model_dir).logits(input_ids)
