"""A quantization plan: which format each routed expert is stored in, at which granularity, and the
optional expert placement (a per-layer permutation). The checkpoint layout asks the plan what to
write; the formats module produces the bytes; the embedded engine reads the plan back from
config.json. Routers, the shared-expert gate, embeddings, lm_head, norms, attention, shared experts
and dense MLPs are never quantized (``EXCLUDED``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import InputError, UnsupportedError
from .formats import FORMATS, QuantFormat, float_format_for

FLOAT = "float"  # the model dtype, unquantized (16 bits for fp16/bf16 models)
_FLOAT_ALIASES = {"float", "fp16", "bf16", "fp32"}
EXCLUDED = ["*lm_head", "*router", "*vocab_embedding", "*shared_expert_gate", "*shared_expert*", "*attention*",
            "*layernorm*", "*ln_f"]
PER_EXPERT_MARK = "trtmoe-per-expert"


def canonical(name: str) -> str:
    if name in _FLOAT_ALIASES:
        return FLOAT
    if name not in FORMATS:
        raise UnsupportedError(f"unknown format {name!r}",
                               hint="use fp16 or one of " + ", ".join(f for f in FORMATS if f not in _FLOAT_ALIASES))
    return name


def format_obj(name: str, dtype: torch.dtype) -> QuantFormat:
    return float_format_for(dtype) if name == FLOAT else FORMATS[name]


def expert_shape_problem(name: str, hidden: int, inter_local: int) -> str | None:
    """Why a routed expert (fc [2·I_loc, H], proj [H, I_loc] per rank) cannot be stored in ``name``."""
    if name == FLOAT:
        return None
    fmt = FORMATS[name]
    return fmt.shape_problem(2 * inter_local, hidden) or fmt.shape_problem(hidden, inter_local)


@dataclass
class QuantPlan:
    """``formats[l][e]`` = format of original expert ``e`` of MoE layer ``l`` (global index).
    ``permutations[l][slot]`` = the original expert placed in ``slot`` (identity when absent)."""

    formats: dict[int, list[str]]
    granularity: str = "expert"  # "expert" (embedded engine) or "layer" (TensorRT-LLM fused MoE)
    permutations: dict[int, list[int]] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float16

    def __post_init__(self):
        self.formats = {int(l): [canonical(f) for f in fs] for l, fs in self.formats.items()}
        self.permutations = {int(l): list(map(int, p)) for l, p in self.permutations.items()}
        if self.granularity not in ("expert", "layer"):
            raise InputError(f"granularity must be 'expert' or 'layer', got {self.granularity!r}")
        if self.granularity == "layer":
            for l, fs in self.formats.items():
                if len(set(fs)) > 1:
                    raise InputError(f"layer {l} mixes formats {sorted(set(fs))} but granularity is 'layer'")
        for l, p in self.permutations.items():
            if sorted(p) != list(range(len(p))):
                raise InputError(f"placement for layer {l} is not a permutation: {p}")

    # ---- queries used by the layout and the engine ----------------------------------------------
    def perm(self, layer: int, num_experts: int) -> list[int]:
        return self.permutations.get(layer, list(range(num_experts)))

    def slot_format(self, layer: int, slot: int, num_experts: int) -> str:
        fs = self.formats.get(layer)
        if fs is None:
            return FLOAT
        return fs[self.perm(layer, num_experts)[slot]]

    def layer_format(self, layer: int) -> str:
        fs = self.formats.get(layer) or [FLOAT]
        assert len(set(fs)) == 1
        return fs[0]

    def used_formats(self) -> set[str]:
        return {f for fs in self.formats.values() for f in fs}

    @property
    def is_float(self) -> bool:
        return self.used_formats() <= {FLOAT}

    # ---- what the writer asks ---------------------------------------------------------------------
    def bind(self, model, mapping) -> None:
        """Check the plan against the model and layout; called by the writer before any work."""
        self._model, self._mapping = model, mapping
        for l, fs in self.formats.items():
            if not (0 <= l < model.num_layers and model.moe_layers[l]):
                raise InputError(f"plan names layer {l}, which is not a MoE layer")
            if len(fs) != model.num_experts:
                raise InputError(f"plan for layer {l} has {len(fs)} formats for {model.num_experts} experts")
        I_loc = model.expert_intermediate_size // mapping.moe_tp_size
        for name in sorted(self.used_formats()):
            if expert_shape_problem(name, model.hidden_size, I_loc):
                g = getattr(FORMATS[name], "group_size", None)
                need = f"to be multiples of {g}" if g else "to fit its packing"
                fit = [f for f in FORMATS if f not in _FLOAT_ALIASES
                       and not expert_shape_problem(f, model.hidden_size, I_loc)]
                raise UnsupportedError(
                    f"{name} needs hidden size ({model.hidden_size}) and per-rank expert FFN size ({I_loc}) "
                    f"{need}", hint=f"formats that fit: {', '.join(fit) or 'none'}; or a smaller moe_tp")
        if self.granularity == "layer" and not self.is_float and mapping.pp_size > 1 and (
                len({f for f in self.used_formats()}) > 1 or not all(model.moe_layers)):
            raise UnsupportedError("layer-mixed quantization with pp > 1 cannot be expressed for TensorRT-LLM "
                                   "(its per-layer config keys use local layer indices)", hint="use pp=1")

    def _tensorrt_algo(self) -> tuple[str | None, dict]:
        used = self.used_formats() - {FLOAT}
        if not used:
            return None, {}
        if self.granularity == "expert" or len(self.used_formats()) > 1 or any(
                l not in self.formats for l in range(self._model.num_layers) if self._model.moe_layers[l]):
            return "MIXED_PRECISION", {}
        # One format for every MoE layer: a plain config (group_size, if any, is checkpoint-wide).
        (name,) = used
        cfg = FORMATS[name].trtllm_layer_config()
        return cfg.pop("quant_algo"), cfg

    def exclude_modules(self) -> list[str]:
        m = self._model
        dense = [f"transformer.layers.{l}.mlp*" for l in range(m.num_layers) if not m.moe_layers[l]]
        return EXCLUDED + dense

    def quantization_config(self) -> dict:
        algo, extra = self._tensorrt_algo()
        if algo is None:
            return {"quant_algo": None, "kv_cache_quant_algo": None}
        out = {"quant_algo": algo, "kv_cache_quant_algo": None, **extra}
        if algo != "MIXED_PRECISION":
            out["exclude_modules"] = self.exclude_modules()
        return out

    def config_extra(self) -> dict:
        return {"quantization": {"granularity": self.granularity,
                                 "expert_formats": {str(l): [self.slot_format(l, s, len(fs)) for s in range(len(fs))]
                                                    for l, fs in sorted(self.formats.items())},
                                 "placement": {str(l): p for l, p in sorted(self.permutations.items())},
                                 "excluded": self.exclude_modules()}}

    def write_sidecars(self, out: Path) -> None:
        algo, _ = self._tensorrt_algo()
        if algo != "MIXED_PRECISION":
            return
        layers = {}
        m, mp = self._model, self._mapping
        for l in sorted(self.formats):
            _, j = mp.layer_owner(m.num_layers, l)
            if self.granularity == "layer":
                name = self.layer_format(l)
                if name == FLOAT:
                    continue
                for mod in ("fc", "proj"):
                    layers[f"transformer.layers.{j}.mlp.{mod}"] = _layer_entry(name)
            else:
                for s in range(m.num_experts):
                    name = self.slot_format(l, s, m.num_experts)
                    if name != FLOAT:
                        for mod in ("fc", "proj"):
                            layers[f"transformer.layers.{j}.mlp.experts.{s}.{mod}"] = _layer_entry(name)
        cfg = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "quantized_layers": layers}
        if self.granularity == "expert":
            # Unmistakable: TensorRT-LLM's fused MoE plugin takes one format per layer.
            cfg["trtmoe_granularity"] = PER_EXPERT_MARK
        (out / "quant_cfg.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    def manifest_entry(self) -> dict:
        return {"granularity": self.granularity, "formats_used": sorted(self.used_formats()),
                "excluded": self.exclude_modules(), **self.meta}

    # ---- persistence --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"granularity": self.granularity, "formats": {str(k): v for k, v in self.formats.items()},
                "permutations": {str(k): v for k, v in self.permutations.items()}, "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict) -> "QuantPlan":
        return cls(formats={int(k): v for k, v in d["formats"].items()}, granularity=d.get("granularity", "expert"),
                   permutations={int(k): v for k, v in (d.get("permutations") or {}).items()},
                   meta=d.get("meta") or {})


def _layer_entry(name: str) -> dict:
    return FORMATS[name].trtllm_layer_config()


def uniform_plan(model, fmt: str, granularity: str = "layer") -> QuantPlan:
    """Every routed expert in ``fmt``."""
    return QuantPlan({l: [fmt] * model.num_experts for l in range(model.num_layers) if model.moe_layers[l]},
                     granularity=granularity, meta={"policy": f"uniform-{fmt}"})
