"""Rotary position embeddings: per-position cos / signed-sin tables shared by every layer of a
forward, RoPE or Phi-3 LongRoPE (short factors and scale while a sequence stays within
original_max_position_embeddings, long ones beyond)."""

from __future__ import annotations

import torch


class Rotary:
    """RoPE tables of one model (gpt-neox halves), built lazily per dtype and grown on demand; with
    Phi-3 LongRoPE, a short- and a long-context table (factors and cos/sin scale)."""

    def __init__(self, cfg, device: torch.device):
        hd = cfg.head_dim
        self.longrope = lr = cfg.longrope
        expo = cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd)
        self._inv_freq = (1.0 / expo).to(device)
        self._sign = torch.cat((-torch.ones(hd // 2), torch.ones(hd // 2))).to(device)
        if lr is not None:  # (inverse frequencies, cos/sin scale) for short and long contexts
            self._longrope = tuple((1.0 / (torch.tensor(lr[f"{n}_factor"], dtype=torch.float32) * expo)).to(device)
                                   for n in ("short", "long"))
            self._mscale = (lr["short_mscale"], lr["long_mscale"])
        self._cache: dict[tuple[bool, torch.dtype], torch.Tensor] = {}

    def tables(self, pos: torch.Tensor, dtype: torch.dtype, n_pos: int, lengths: list[int] | None,
               limit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, 1, hd] for positions pos [B, T] (gpt-neox halves), all below ``n_pos``;
        shared by all layers. They are rows of per-position tables computed once (element by
        element the same float32 arithmetic as computing them for the step's positions).

        LongRoPE picks the short or long factors per sequence: long once the sequence (``lengths``,
        its tokens so far including this forward's; ``n_pos`` for every row when not given) is
        longer than original_max_position_embeddings, so a row never depends on its batch. A table
        that must grow grows ahead of need, up to ``limit`` (the engine's max_seq_len)."""
        lr = self.longrope
        if lr is None:
            return self._rows(False, pos, dtype, n_pos, limit)
        orig = lr["original_max_position_embeddings"]
        longs = [n > orig for n in (lengths if lengths is not None else [n_pos])]
        if all(longs) or not any(longs):
            return self._rows(longs[0], pos, dtype, n_pos, limit)
        pick = torch.tensor(longs, device=pos.device)[:, None, None, None]
        (cs, ss), (cl, sl) = (self._rows(k, pos, dtype, n_pos, limit) for k in (False, True))
        return torch.where(pick, cl, cs), torch.where(pick, sl, ss)

    def _rows(self, long: bool, pos: torch.Tensor, dtype: torch.dtype, n_pos: int, limit: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        tab = self._cache.get((long, dtype))
        if tab is None or tab.shape[0] < n_pos:
            tab = self._table(long, max(n_pos, min(2 * (0 if tab is None else tab.shape[0]), limit), 256), dtype)
            self._cache[(long, dtype)] = tab
        cs = tab[pos]  # [B, T, 2, hd]
        return cs[:, :, 0:1], cs[:, :, 1:2]

    def _table(self, long: bool, n: int, dtype: torch.dtype) -> torch.Tensor:
        """[n, 2, hd]: cos and signed sin of positions 0..n-1."""
        inv, scale = self._inv_freq, None
        if self.longrope is not None:
            inv, scale = self._longrope[long], self._mscale[long]
        freqs = torch.arange(n, device=inv.device).float()[:, None] * inv  # [n, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        # The sine's first half negated: rotate_half(x) * sin == x.roll(hd/2) * signed sin, exactly.
        cos, sin = emb.cos(), emb.sin() * self._sign
        if scale is not None:
            cos, sin = cos * scale, sin * scale
        return torch.stack((cos.to(dtype), sin.to(dtype)), 1)

    @staticmethod
    def apply(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [B, T, heads, hd] rotated by the step's tables (gpt-neox halves: x * cos +
        rotate_half(x) * sin, rotate_half(x) = [-x2, x1], with the sign carried by ``sin``)."""
        cos, sin = rope
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
