"""Activation-aware codes for the routed experts of a unified-HF checkpoint (``convert --target
trtllm-pytorch|vllm|sglang --calib C``).

The calibration that measured the candidates' sensitivities rounded each expert matrix in FP8 / NVFP4 /
MXFP4 / FP8-block with its rounding (``trtmoe.quant.fp_gptq`` through ``awq.quantize``); the export writes
the codes that same rounding chooses, from the same statistics: the calibration's stored MoE inputs of
each layer (``activations.safetensors`` and ``moe-inputs/``), from which each expert matrix's input Gram
matrix is rebuilt — gate / up (``w1`` / ``w3``, ``gate_proj`` / ``up_proj``) from the tokens routed to
the expert, down (``w2``, ``down_proj``) from ``silu(gate x) * up x`` computed with the expert's own
gate and up weights in the model dtype, as calibration computed it. Only ``weight`` and the block scales
differ from round to nearest; the global scale (a fused gate/up group's shared amax), the input scale and
every tensor's layout are the format's (``formats.py``).

Attention, shared experts and dense MLPs have no routed-token statistics and stay round to nearest, as
do the unquantized formats, INT8 W8A16 and W4A8-AWQ (their own searches live elsewhere).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from ..errors import InputError
from ..quant import awq, fp_gptq
from ..quant.formats import QuantFormat

FC_ROLES = ("gate", "up")


class UnifiedRounding:
    """Rounds a unified-HF export's routed-expert linears with ``rounding`` (gptq, awq_gptq, awq) from
    ``stats`` (a calibration's activation statistics)."""

    def __init__(self, stats: "awq.ActivationStats", rounding: str, dtype: torch.dtype):
        if rounding not in awq.ROUNDINGS or rounding == "rtn":
            raise InputError(f"unknown activation-aware rounding {rounding!r}", hint=awq.ROUNDING_HINT)
        self.stats, self.rounding, self.dtype = stats, rounding, dtype
        self._siblings: dict[tuple[int, int], dict[str, str]] | None = None
        self._fc: tuple[tuple[int, int], Tensor] | None = None
        self.counts = {"rounded": 0, "nearest": 0}

    @classmethod
    def from_calibration(cls, calib_dir: str | Path, rounding: str, dtype: torch.dtype) -> "UnifiedRounding":
        d = Path(calib_dir)
        f = (d if d.is_dir() else d.parent) / awq.ACT_FILE
        if not f.is_file():
            raise InputError(f"{rounding} rounding needs the calibration's activation statistics, which are missing",
                             where=str(f), hint=f"recalibrate (`trtmoe calibrate ... --rounding {rounding}`), or "
                                                "convert with --rounding rtn")
        stats = awq.ActivationStats.load(f)
        stats.check_inputs()
        return cls(stats, rounding, dtype)

    def _expert_tensors(self, mod, source) -> dict[str, str]:
        """role -> source tensor name of ``mod``'s expert (its gate, up and down linears)."""
        if self._siblings is None:
            self._siblings = {}
            for m in source.modules():
                if m.kind == "expert" and not m.stacked:
                    self._siblings.setdefault((m.layer, _expert_index(m.name)), {})[m.expert_role] = m.tensor
        return self._siblings.get((mod.layer, _expert_index(mod.name)), {})

    def _fc_weight(self, mod, source) -> Tensor:
        """The expert's ``fc`` as calibration holds it: [up; gate] [2I, H] in the model dtype."""
        key = (mod.layer, _expert_index(mod.name))
        if self._fc is None or self._fc[0] != key:
            names = self._expert_tensors(mod, source)
            if not all(r in names for r in FC_ROLES):
                raise InputError(f"{mod.name}: the gate and up linears of its expert were not found")
            self._fc = (key, torch.cat([source.read(names["up"]).to(self.dtype),
                                        source.read(names["gate"]).to(self.dtype)]))
        return self._fc[1]

    def quantize(self, mod, fmt: QuantFormat, w: Tensor, input_amax, weight_amax, source) -> dict[str, Tensor] | None:
        """Module ``mod``'s tensors (``{suffix: tensor}`` as ``fmt.modelopt_export`` lays them out) under
        the rounding, or None where it does not apply (round to nearest then)."""
        if mod.kind != "expert" or mod.stacked or not fp_gptq.applies(fmt) or mod.expert_role not in (*FC_ROLES, "down"):
            return None
        e = _expert_index(mod.name)
        kind = "proj" if mod.expert_role == "down" else "fc"
        st = self.stats.get(mod.layer, e, kind)
        if st is None:
            raise InputError(f"the calibration's activation statistics lack layer {mod.layer} expert {e} {kind}",
                             hint="calibrate this model (trtmoe calibrate), or convert with --rounding rtn")
        if kind == "proj":
            st = st.with_fc(lambda: self._fc_weight(mod, source))
        packed = awq.fp_quantize(fmt, w, dtype=w.dtype, stats=st, rounding=self.rounding, input_amax=input_amax,
                                 weight_amax=weight_amax)
        base = fmt.quantize(w, dtype=w.dtype, input_amax=input_amax, weight_amax=weight_amax)
        same = all(torch.equal(packed[k].view(torch.uint8) if packed[k].dtype == torch.float8_e4m3fn else packed[k],
                               base[k].view(torch.uint8) if base[k].dtype == torch.float8_e4m3fn else base[k])
                   for k in base)
        self.counts["nearest" if same else "rounded"] += 1
        return {s: packed[s].reshape(shape) for s, _, shape in fmt.modelopt_tensor_specs(*w.shape[-2:], w.dtype)}


def _expert_index(name: str) -> int:
    """The expert number in a routed expert's module name (``...experts.{e}.w1``)."""
    try:
        return int(name.rsplit(".", 2)[1])
    except (IndexError, ValueError):
        raise InputError(f"{name}: no expert number in the module name") from None
