"""Grouped-query attention (multi-head attention being the case of one query head per KV head):
one fused [q; k; v] projection (optional bias), optional per-head RMSNorm of queries and keys
(Qwen3), rotary embeddings, scaled dot-product attention over the sequence's pooled cache, and the
output projection (optional bias). TensorRT-LLM's ``attention.qkv`` / ``attention.dense``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...matmul import Dense
from ..norms import rms_norm
from ..rope import Rotary

KIND = "gqa"


class GroupedQueryAttention:
    """One layer's attention weights and its forward."""

    def __init__(self, cfg, wqkv: Dense, wo: Dense, bqkv: torch.Tensor | None = None, bo: torch.Tensor | None = None,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None):
        self.head_dim, self.num_heads, self.num_kv_heads = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.eps = cfg.norm_eps
        self.wqkv, self.wo, self.bqkv, self.bo = wqkv, wo, bqkv, bo  # wqkv: [q; k; v] rows, one matmul
        self.q_norm, self.k_norm = q_norm, k_norm

    @classmethod
    def from_roles(cls, cfg, t: dict, vec, mat) -> "GroupedQueryAttention":
        """From a layer's tensors by role (``t``; absent roles are None): ``vec`` holds a vector (bias,
        norm weight) as the engine computes with it, ``mat`` a weight matrix."""
        return cls(cfg, mat(t["q"]), mat(t["o"]), vec(t.get("q_bias")), vec(t.get("o_bias")),
                   vec(t.get("q_norm")), vec(t.get("k_norm")))

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 cache: tuple[torch.Tensor, torch.Tensor] | None, seqs: list | None, plan: dict | None
                 ) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]. ``cache``: this layer's pooled keys and values (None: a plain
        causal forward over ``x`` alone); ``seqs`` the batch's sequences and ``plan`` where they
        write and read it (``trtmoe.runtime.kvcache.cache_plan``)."""
        B, T, _ = x.shape
        hd, nh, nkv = self.head_dim, self.num_heads, self.num_kv_heads
        qkv = self.wqkv(x)
        if self.bqkv is not None:
            qkv = qkv + self.bqkv
        v = qkv[..., (nh + nkv) * hd:].view(B, T, nkv, hd)
        if self.q_norm is not None:
            q, k = qkv[..., :nh * hd].view(B, T, nh, hd), qkv[..., nh * hd:(nh + nkv) * hd].view(B, T, nkv, hd)
            qk = torch.cat((rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)), 2)
        else:
            qk = qkv[..., :(nh + nkv) * hd].view(B, T, nh + nkv, hd)
        qk = Rotary.apply(qk, rope)  # queries and keys rotated in one go
        q, k = qk[:, :, :nh].transpose(1, 2), qk[:, :, nh:]  # q [B, heads, T, hd]; k, v [B, T, heads, hd]
        if seqs is None:  # plain causal forward, no cache
            kk, vv, mask = k, v, None
            causal = True
        else:
            # Append to each sequence's pooled cache, then attend over its own history.
            kp, vp = cache
            if T == 1:  # decode: one indexed write into the flat rows for the whole batch
                kp.view(-1, hd).index_copy_(0, plan["write_at"], k.reshape(B * nkv, hd))
                vp.view(-1, hd).index_copy_(0, plan["write_at"], v.reshape(B * nkv, hd))
            elif plan["rows"] is not None and plan["same_start"] is not None:  # one block write
                a = plan["same_start"]
                kp[plan["rows"], :, a:a + T] = k.transpose(1, 2)
                vp[plan["rows"], :, a:a + T] = v.transpose(1, 2)
            else:
                for b, s in enumerate(seqs):
                    kp[s.slot, :, s.length:s.length + T] = k[b].transpose(0, 1)
                    vp[s.slot, :, s.length:s.length + T] = v[b].transpose(0, 1)
            Lmax = plan["Lmax"]
            if plan["rows"] is not None:  # a contiguous block of rows: a view
                kk, vv = kp[plan["rows"], :, :Lmax], vp[plan["rows"], :, :Lmax]
            else:
                kk = kp[:, :, :Lmax].index_select(0, plan["slot_t"])
                vv = vp[:, :, :Lmax].index_select(0, plan["slot_t"])
            mask = plan["mask"]
            causal = False
            if T == 1 and nh != nkv:
                # One query per sequence: a KV head's query heads are rows of one query block
                # against that head's keys, so no grouped-query expansion is needed.
                o = F.scaled_dot_product_attention(q.reshape(B, nkv, nh // nkv, hd), kk, vv, attn_mask=mask,
                                                   scale=1.0 / math.sqrt(hd))
                o = self.wo(o.reshape(B, T, nh * hd))
                return o if self.bo is None else o + self.bo
        if seqs is None:
            kk, vv = kk.transpose(1, 2), vv.transpose(1, 2)  # [B, heads, L, hd] views
        # Grouped-query heads read their shared KV head in place (no repeated copy of the cache).
        o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=causal and T > 1,
                                           scale=1.0 / math.sqrt(hd), enable_gqa=nh != nkv)
        o = self.wo(o.transpose(1, 2).reshape(B, T, nh * hd))
        return o if self.bo is None else o + self.bo
