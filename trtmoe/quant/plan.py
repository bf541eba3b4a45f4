"""A quantization plan: which format each routed expert (or each of its two matrices) is stored in,
at which granularity, and the optional expert placement (a per-layer permutation). The checkpoint
layout asks the plan what to write; the formats module produces the bytes; the embedded engine reads
the plan back from config.json. Routers, the shared-expert gate, embeddings, lm_head, norms,
attention, shared experts and dense MLPs are never quantized (``EXCLUDED``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..errors import InputError, UnsupportedError
from .formats import FORMATS, QuantFormat, float_format_for

FLOAT = "float"  # the model dtype, unquantized (16 bits for fp16/bf16 models)
_FLOAT_ALIASES = {"float", "fp16", "bf16", "fp32"}
EXCLUDED = ["*lm_head", "*router", "*vocab_embedding", "*shared_expert_gate", "*shared_expert*", "*attention*",
            "*layernorm*", "*ln_f"]
PER_EXPERT_MARK = "trtmoe-per-expert"
# Coarsest last. "matrix" and "expert" use trtmoe's per-expert tensor layout (embedded engine only);
# "layer" is what TensorRT-LLM's fused MoE plugin runs (one format per MoE layer).
GRANULARITIES = ("matrix", "expert", "layer")
MATRICES = ("fc", "proj")  # fc = [up; gate] [2I, H] (2/3 of an expert's weights), proj = down [H, I]


def canonical(name: str) -> str:
    if name in _FLOAT_ALIASES:
        return FLOAT
    if name not in FORMATS:
        raise UnsupportedError(f"unknown format {name!r}",
                               hint="use fp16 or one of " + ", ".join(f for f in FORMATS if f not in _FLOAT_ALIASES))
    return name


def format_obj(name: str, dtype: torch.dtype) -> QuantFormat:
    return float_format_for(dtype) if name == FLOAT else FORMATS[name]


def matrix_shape(mod: str, hidden: int, inter: int) -> tuple[int, int]:
    """(out, in) of an expert's ``fc`` ([up; gate]) or ``proj`` (down) for FFN size ``inter``."""
    return (2 * inter, hidden) if mod == "fc" else (hidden, inter)


def matrix_shape_problem(name: str, mod: str, hidden: int, inter_local: int) -> str | None:
    """Why an expert's ``mod`` matrix (per rank: FFN size ``inter_local``) cannot be stored in ``name``."""
    if name == FLOAT:
        return None
    return FORMATS[name].shape_problem(*matrix_shape(mod, hidden, inter_local))


def expert_shape_problem(name: str, hidden: int, inter_local: int) -> str | None:
    """Why a routed expert (fc [2·I_loc, H], proj [H, I_loc] per rank) cannot be stored in ``name``."""
    return (matrix_shape_problem(name, "fc", hidden, inter_local)
            or matrix_shape_problem(name, "proj", hidden, inter_local))


@dataclass(frozen=True)
class QuantPlan:
    """``formats[l][e]`` = format of original expert ``e`` of MoE layer ``l`` (global index): of both
    its matrices at ``expert`` and ``layer`` granularity, of its ``fc`` at ``matrix`` granularity,
    where ``proj_formats[l][e]`` is the format of its ``proj`` (a copy of ``formats`` when not given).
    ``permutations[l][slot]`` = the original expert placed in ``slot`` (identity when absent).

    A plan is a value: it is checked when made, and ``bind`` returns a new plan that also knows the
    model and layout it is written for (what the config blocks, the sidecar and the manifest entry
    need); nothing about it changes afterwards, so no method depends on what was called before it.
    ``meta`` holds what the plan was made from and notes for the user (the manifest keeps it); the
    steps that add to it (calibration identity, placement, rounding) return new plans too."""

    formats: dict[int, list[str]]
    granularity: str = "expert"  # "matrix" / "expert" (embedded engine) or "layer" (TensorRT-LLM fused MoE)
    permutations: dict[int, list[int]] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float16
    proj_formats: dict[int, list[str]] | None = None
    # Set by ``bind``: the model (trtmoe.model.description.ModelSpec) and Mapping the plan is written for.
    model: object = field(default=None, compare=False, repr=False)
    mapping: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        self._set("formats", {int(l): [canonical(f) for f in fs] for l, fs in self.formats.items()})
        self._set("permutations", {int(l): list(map(int, p)) for l, p in self.permutations.items()})
        if self.granularity not in GRANULARITIES:
            raise InputError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {self.granularity!r}")
        proj = None if self.proj_formats is None else {
            int(l): [canonical(f) for f in fs] for l, fs in self.proj_formats.items()}
        if proj is not None and (set(proj) != set(self.formats)
                                 or any(len(proj[l]) != len(fs) for l, fs in self.formats.items())):
            raise InputError("proj_formats must name the same layers and experts as formats")
        if self.granularity == "matrix":
            self._set("proj_formats", proj if proj is not None else {l: list(fs) for l, fs in self.formats.items()})
        else:
            if proj is not None and proj != self.formats:
                raise InputError(f"fc and proj formats differ, which granularity {self.granularity!r} cannot "
                                 "express", hint="use granularity 'matrix' (embedded engine only)")
            self._set("proj_formats", None)
        if self.granularity == "layer":
            for l, fs in self.formats.items():
                if len(set(fs)) > 1:
                    raise InputError(f"layer {l} mixes formats {sorted(set(fs))} but granularity is 'layer'")
        for l, p in self.permutations.items():
            if sorted(p) != list(range(len(p))):
                raise InputError(f"placement for layer {l} is not a permutation: {p}")

    def _set(self, name: str, value) -> None:  # normalisation while the value is being made
        object.__setattr__(self, name, value)

    def placed(self, permutations: dict[int, list[int]], report: dict | None = None) -> "QuantPlan":
        """The same plan with experts placed by ``permutations`` (and the placement report in meta)."""
        meta = dict(self.meta)
        if report is not None:
            meta["placement"] = {str(k): v for k, v in report.items()}
        return replace(self, permutations=permutations, meta=meta)

    # ---- queries used by the layout and the engine ----------------------------------------------
    @property
    def per_expert_layout(self) -> bool:
        """Whether the checkpoint stores one tensor set per expert (embedded engine only)."""
        return self.granularity in ("matrix", "expert")

    def perm(self, layer: int, num_experts: int) -> list[int]:
        return self.permutations.get(layer, list(range(num_experts)))

    def matrix_formats(self, mod: str) -> dict[int, list[str]]:
        """Per layer, the format of every original expert's ``mod`` matrix ("fc" or "proj")."""
        if mod not in MATRICES:
            raise ValueError(f"unknown expert matrix {mod!r}")
        return self.proj_formats if mod == "proj" and self.proj_formats is not None else self.formats

    def matrix_format(self, layer: int, expert: int, mod: str) -> str:
        """Format of original expert ``expert``'s ``mod`` matrix in ``layer`` (float when not planned)."""
        fs = self.matrix_formats(mod).get(layer)
        return FLOAT if fs is None else fs[expert]

    def slot_matrix_format(self, layer: int, slot: int, mod: str, num_experts: int) -> str:
        """Format of the ``mod`` matrix of the expert placed in ``slot``."""
        return self.matrix_format(layer, self.perm(layer, num_experts)[slot], mod)

    def layer_format(self, layer: int) -> str:
        fs = self.formats.get(layer) or [FLOAT]
        assert len(set(fs)) == 1
        return fs[0]

    def used_formats(self) -> set[str]:
        return {f for mod in MATRICES for fs in self.matrix_formats(mod).values() for f in fs}

    def used_matrix_formats(self) -> dict[str, set[str]]:
        """Formats used per matrix kind ("fc", "proj")."""
        return {mod: {f for fs in self.matrix_formats(mod).values() for f in fs} for mod in MATRICES}

    @property
    def is_float(self) -> bool:
        return self.used_formats() <= {FLOAT}

    # ---- what the writer asks ---------------------------------------------------------------------
    def bind(self, model, mapping, dtype: torch.dtype | None = None) -> "QuantPlan":
        """This plan for ``model`` laid out by ``mapping`` with weights in ``dtype``, checked against
        both (the writer binds before any work)."""
        for l, fs in self.formats.items():
            if not (0 <= l < model.num_layers and model.moe_layers[l]):
                raise InputError(f"plan names layer {l}, which is not a MoE layer")
            if len(fs) != model.num_experts:
                raise InputError(f"plan for layer {l} has {len(fs)} formats for {model.num_experts} experts")
        I_loc = mapping.expert_ffn_per_rank(model.expert_intermediate_size)
        H = model.hidden_size
        if self.granularity == "matrix":
            self._check_matrix_shapes(H, I_loc)
        else:
            for name in sorted(self.used_formats()):
                if expert_shape_problem(name, H, I_loc):
                    g = getattr(FORMATS[name], "group_size", None)
                    need = f"to be multiples of {g}" if g else "to fit its packing"
                    fit = [f for f in FORMATS if f not in _FLOAT_ALIASES
                           and not expert_shape_problem(f, H, I_loc)]
                    raise UnsupportedError(
                        f"{name} needs hidden size ({H}) and per-rank expert FFN size ({I_loc}) "
                        f"{need}", hint=f"formats that fit: {', '.join(fit) or 'none'}; or a smaller moe_tp")
        if self.granularity == "layer" and not self.is_float and mapping.pp_size > 1 and (
                len({f for f in self.used_formats()}) > 1 or not all(model.moe_layers)):
            raise UnsupportedError("layer-mixed quantization with pp > 1 cannot be expressed for TensorRT-LLM "
                                   "(its per-layer config keys use local layer indices)", hint="use pp=1")
        return replace(self, model=model, mapping=mapping, dtype=self.dtype if dtype is None else dtype)

    def _bound(self):
        if self.model is None or self.mapping is None:
            raise TypeError("this QuantPlan is not bound to a model and layout: use plan.bind(model, mapping)")
        return self.model, self.mapping

    def _check_matrix_shapes(self, H: int, I_loc: int) -> None:
        # Each matrix only needs its own shape to fit (g128 may fit fc's H but not proj's I_loc).
        for mod, names in self.used_matrix_formats().items():
            for name in sorted(names):
                problem = matrix_shape_problem(name, mod, H, I_loc)
                if problem:
                    fit = [f for f in FORMATS if f not in _FLOAT_ALIASES and not matrix_shape_problem(f, mod, H, I_loc)]
                    o, i = matrix_shape(mod, H, I_loc)
                    raise UnsupportedError(f"{name} cannot store the experts' {mod} [{o}, {i}] per rank: {problem}",
                                           hint=f"formats that fit {mod}: {', '.join(fit) or 'none'}; "
                                                "or a smaller moe_tp")

    def _tensorrt_algo(self) -> tuple[str | None, dict]:
        used = self.used_formats() - {FLOAT}
        if not used:
            return None, {}
        m, _ = self._bound()
        if self.per_expert_layout or len(self.used_formats()) > 1 or any(
                l not in self.formats for l in range(m.num_layers) if m.moe_layers[l]):
            return "MIXED_PRECISION", {}
        # One format for every MoE layer: a plain config (group_size, if any, is checkpoint-wide).
        (name,) = used
        if not FORMATS[name].engine_path:
            # A fused-MoE format (ModelOpt unified-HF names): trtmoe's own record says what each layer
            # holds, as for the per-expert layout; the support table refuses it for trtllm-build.
            return "MIXED_PRECISION", {}
        cfg = FORMATS[name].trtllm_layer_config()
        return cfg.pop("quant_algo"), cfg

    def exclude_modules(self) -> list[str]:
        m, _ = self._bound()
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
        """The ``trtmoe.quantization`` block of config.json: formats per expert *slot*, under
        ``expert_formats`` (expert / layer granularity) or ``matrix_formats.fc`` / ``.proj`` (matrix
        granularity, so that no reader can take one matrix's format for the whole expert's)."""
        def slots(mod, l, n):
            return [self.slot_matrix_format(l, s, mod, n) for s in range(n)]

        q = {"granularity": self.granularity}
        if self.granularity == "matrix":
            q["matrix_formats"] = {mod: {str(l): slots(mod, l, len(fs)) for l, fs in sorted(self.formats.items())}
                                   for mod in MATRICES}
        else:
            q["expert_formats"] = {str(l): slots("fc", l, len(fs)) for l, fs in sorted(self.formats.items())}
        q["placement"] = {str(l): p for l, p in sorted(self.permutations.items())}
        q["excluded"] = self.exclude_modules()
        return {"quantization": q}

    def write_sidecars(self, out: Path) -> None:
        algo, _ = self._tensorrt_algo()
        if algo != "MIXED_PRECISION":
            return
        layers = {}
        m, mp = self._bound()
        for l in sorted(self.formats):
            _, j = mp.layer_owner(m.num_layers, l)
            if self.granularity == "layer":
                name = self.layer_format(l)
                if name == FLOAT:
                    continue
                for mod in ("fc", "proj"):
                    layers[f"transformer.layers.{j}.mlp.{mod}"] = _layer_entry(name)
            else:
                # One entry per expert matrix, each with its own format (fc and proj may differ).
                for s in range(m.num_experts):
                    for mod in MATRICES:
                        name = self.slot_matrix_format(l, s, mod, m.num_experts)
                        if name != FLOAT:
                            layers[f"transformer.layers.{j}.mlp.experts.{s}.{mod}"] = _layer_entry(name)
        cfg = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "quantized_layers": layers}
        if self.per_expert_layout:
            # Unmistakable: TensorRT-LLM's fused MoE plugin takes one format per layer.
            cfg["trtmoe_granularity"] = PER_EXPERT_MARK
        (out / "quant_cfg.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    def manifest_entry(self) -> dict:
        return {"granularity": self.granularity, "formats_used": sorted(self.used_formats()),
                "excluded": self.exclude_modules(), **self.meta}

    # ---- persistence --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {"granularity": self.granularity, "formats": {str(k): v for k, v in self.formats.items()},
             "permutations": {str(k): v for k, v in self.permutations.items()}, "meta": self.meta}
        if self.proj_formats is not None:
            d["proj_formats"] = {str(k): v for k, v in self.proj_formats.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "QuantPlan":
        proj = d.get("proj_formats")
        return cls(formats={int(k): v for k, v in d["formats"].items()}, granularity=d.get("granularity", "expert"),
                   permutations={int(k): v for k, v in (d.get("permutations") or {}).items()},
                   meta=d.get("meta") or {},
                   proj_formats=None if proj is None else {int(k): v for k, v in proj.items()})


def _layer_entry(name: str) -> dict:
    return FORMATS[name].trtllm_layer_config()


def uniform_plan(model, fmt: str, granularity: str = "layer") -> QuantPlan:
    """Every routed expert (both matrices) in ``fmt``."""
    return QuantPlan({l: [fmt] * model.num_experts for l in range(model.num_layers) if model.moe_layers[l]},
                     granularity=granularity, meta={"policy": f"uniform-{fmt}"})
