"""Load a unified-HF checkpoint (ModelOpt's ``export_hf_checkpoint`` layout, which ``trtmoe convert
--target trtllm-pytorch`` also writes) into the embedded engine, from its packed bytes.

What is read:

* ``config.json``: the model, through the architecture registry (``trtmoe.hf.adapters``), the same
  description every other stage uses; ``hf_quant_config.json`` (or, without it, ``config.json``'s
  ``quantization_config`` of ``quant_method: modelopt``) says which format each linear is stored in:
  one ``quant_algo`` with ``exclude_modules`` (fnmatch patterns) or ``MIXED_PRECISION`` with
  ``quantized_layers`` (a module takes the entry of the longest prefix it falls under, else stays
  unquantized). A plain Hugging Face checkpoint (no quantization) loads too.
* the weights by their Hugging Face names (``model.safetensors.index.json`` or the one shard), each
  role the registry names: the registry's rule table says which engine tensor a role goes to, as the
  TensorRT-LLM checkpoint layout does (q/k/v concatenated into qkv, [up; gate] for fused experts).

Each quantized linear runs the engine's kernel of its format (``trtmoe.quant.formats``, the same classes
the TensorRT-LLM-checkpoint path runs): ``FP8`` (E4M3 weights, per-tensor scale, static FP8 inputs under
``input_scale``), ``NVFP4`` (E2M1 weights in blocks of 16 under E4M3 block scales and the global
``weight_scale_2``, NVFP4 inputs under ``input_scale``), ``W4A16_NVFP4``, ``mxfp4`` (E2M1 under E8M0
scales per 32), ``fp8_pb_wo`` (E4M3 in 128 x 128 blocks, weight-only) and ``W8A16`` (INT8 per output
channel, weight-only). Activations are quantized with the checkpoint's own ``input_scale`` on the way
into each linear, as TensorRT-LLM's fused MoE and quantized linears do; weight-only formats take the
activations as they are.

A routed expert's gate and up run as one ``[up; gate]`` matrix (one ``linear`` call, as the fused MoE's
gate_up GEMM) when that is exact: the same format, the per-tensor tensors equal (FP8's ``weight_scale``,
NVFP4's ``weight_scale_2``, the ``input_scale``) and the blocks aligned (FP8 blocks: the expert width a
multiple of 128). Otherwise the two run apart (``SplitExperts``), each with its own scales. Attention,
shared-expert and dense-MLP linears stored quantized run quantized too (``QuantLinear``: the weight is
dequantized once at load, the activations quantized on every call). Anything the engine cannot run as
stored is refused with one line naming it: an unknown ``quant_algo``, a quantized KV cache, a quantized
router, embedding or ``lm_head``, tensors no rule reads.
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import fields
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import CheckpointError, InputError, UnsupportedError
from ..hf.adapters import FIRST, LAST, MOE_TP, VOCAB, Rule, describe, global_rules, layer_rules
from ..hf.reader import read_json
from ..hf.safetensors_io import SafetensorsFile
from ..hf.validate import validate_hf_config
from ..matmul import dense
from ..model.description import ModelSpec
from ..parallel.mapping import Mapping
from ..quant.formats import FORMATS, QuantFormat, float_format_for
from .alloc import give_back_freed_memory
from .checkpoint_reader import CheckpointConfig
from .attention import attention_for
from .engine import EmbeddedEngine
from .layers import Layer
from .experts import ExpertBank, FloatExperts, PackedExperts, PackedShard

# ModelOpt's quant_algo -> the engine format (trtmoe.quant.formats) that runs it.
ENGINE_FORMATS = {
    "FP8": "fp8",
    "NVFP4": "nvfp4",
    "W4A16_NVFP4": "nvfp4_w4a16",
    "mxfp4": "mxfp4",
    "fp8_pb_wo": "fp8_block_wo",
    "W8A16": "int8",
    "W4A8_AWQ": "w4a8_awq",
}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Tensor suffixes each format's linear is stored with (besides ``weight``), as ModelOpt writes them.
_SUFFIXES = {
    "fp8": ("weight_scale", "input_scale"),
    "nvfp4": ("weight_scale", "weight_scale_2", "input_scale"),
    "nvfp4_w4a16": ("weight_scale", "weight_scale_2"),
    "mxfp4": ("weight_scale",),
    "fp8_block_wo": ("weight_scale",),
    "int8": ("weight_scale",),
    "w4a8_awq": ("weight_scale", "weight_scale_2", "pre_quant_scale", "input_scale"),
}


def is_unified_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a Hugging Face-layout checkpoint the unified loader reads: an
    ``hf_quant_config.json``, or a ``config.json`` naming ``architectures`` (HF) rather than a
    TensorRT-LLM ``architecture`` / an embedded engine's ``backend``."""
    p = Path(path)
    if (p / "hf_quant_config.json").is_file():
        return True
    try:
        cfg = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "architectures" in cfg and "backend" not in cfg and "architecture" not in cfg


# ---- the checkpoint ------------------------------------------------------------------------------

class UnifiedCheckpoint:
    """A unified-HF checkpoint directory: its model (``spec``, ``adapter``), the quantization config
    and lazy access to its tensors by name."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise InputError("no config.json here", where=str(self.path))
        raw = read_json(cfg_path)
        self.hf_config = validate_hf_config(raw, cfg_path)
        self.adapter, self.spec = describe(self.hf_config)
        self.quant = self._quant_config(raw)
        kv = self.quant.get("kv_cache_quant_algo")
        if kv:
            raise UnsupportedError(f"kv_cache_quant_algo {kv!r}: the embedded engine keeps its KV cache unquantized",
                                   where=str(self.path), hint="export without a quantized KV cache")
        self.algo = self.quant.get("quant_algo")
        for a in self._algos():
            if a not in ENGINE_FORMATS:
                raise UnsupportedError(f"quant_algo {a!r} is not one the embedded engine runs", where=str(self.path),
                                       hint="it runs " + ", ".join(ENGINE_FORMATS))
        self._files: dict[Path, SafetensorsFile] = {}
        self.location = self._index()
        self.used: set[str] = set()

    def _quant_config(self, raw: dict) -> dict:
        f = self.path / "hf_quant_config.json"
        if f.is_file():
            q = read_json(f)
            if not isinstance(q, dict) or not isinstance(q.get("quantization"), dict):
                raise CheckpointError("hf_quant_config.json has no 'quantization' object", where=str(f))
            return q["quantization"]
        qc = raw.get("quantization_config")
        if qc is None:
            return {"quant_algo": None}
        if not isinstance(qc, dict) or qc.get("quant_method") != "modelopt":
            method = qc.get("quant_method") if isinstance(qc, dict) else qc
            raise UnsupportedError(f"quantization_config quant_method {method!r} is not one the embedded engine reads",
                                   where=str(self.path / "config.json"), hint="it reads ModelOpt (unified-HF) checkpoints")
        return {"quant_algo": qc.get("quant_algo"), "exclude_modules": qc.get("ignore", []),
                "quantized_layers": qc.get("quantized_layers", {}), "kv_cache_quant_algo": qc.get("kv_cache_quant_algo")}

    def _algos(self) -> set[str]:
        if self.algo == "MIXED_PRECISION":
            layers = self.quant.get("quantized_layers")
            if not isinstance(layers, dict):
                raise CheckpointError("MIXED_PRECISION without a quantized_layers object", where=str(self.path))
            return {e.get("quant_algo") for e in layers.values() if isinstance(e, dict)} - {None}
        return set() if self.algo is None else {self.algo}

    def _index(self) -> dict[str, Path]:
        idx = self.path / "model.safetensors.index.json"
        if idx.is_file():
            wm = read_json(idx).get("weight_map")
            if not isinstance(wm, dict):
                raise CheckpointError("index has no weight_map object", where=str(idx))
            out = {}
            for name, shard in wm.items():
                f = self.path / str(shard)
                if Path(str(shard)).name != shard or not f.is_file():
                    raise CheckpointError(f"index names shard {shard!r} (for {name!r}), which is not here", where=str(idx))
                out[name] = f
            return out
        files = sorted(self.path.glob("*.safetensors"))
        if len(files) != 1:
            raise CheckpointError(f"{len(files)} safetensors files and no model.safetensors.index.json",
                                  where=str(self.path))
        return {n: files[0] for n in self._file(files[0]).tensors}

    def _file(self, f: Path) -> SafetensorsFile:
        if f not in self._files:
            self._files[f] = SafetensorsFile(f)
        return self._files[f]

    def has(self, name: str) -> bool:
        return name in self.location

    def read(self, name: str) -> torch.Tensor:
        f = self.location.get(name)
        if f is None:
            raise CheckpointError(f"tensor {name!r} is missing", where=str(self.path))
        t = self._file(f).read(name)
        self.used.add(name)
        return t

    def algo_of(self, module: str) -> str | None:
        """The quant_algo a loader gives ``module`` (a linear's name without ``.weight``)."""
        if self.algo == "MIXED_PRECISION":
            hits = [p for p in self.quant["quantized_layers"] if module == p or module.startswith(p + ".")]
            return self.quant["quantized_layers"][max(hits, key=len)].get("quant_algo") if hits else None
        if self.algo is None:
            return None
        if any(module == p or fnmatch.fnmatchcase(module, p) for p in self.quant.get("exclude_modules") or []):
            return None
        return self.algo

    def linear(self, weight_name: str) -> tuple[QuantFormat | None, dict[str, torch.Tensor]]:
        """One linear's format (None: unquantized) and its tensors in the engine format's convention."""
        module = weight_name[: -len(".weight")]
        algo = self.algo_of(module)
        w = self.read(weight_name)
        if algo is None:
            if not w.is_floating_point() or w.element_size() == 1:
                raise CheckpointError(f"{weight_name} is stored as {w.dtype} but no quantization config covers it",
                                      where=str(self.path))
            return None, {"weight": w}
        name = ENGINE_FORMATS[algo]
        t = {"weight": w}
        for s in _SUFFIXES[name]:
            if not self.has(f"{module}.{s}"):
                raise CheckpointError(f"{module} is {algo} but has no {s}", where=str(self.path))
            t[s] = self.read(f"{module}.{s}")
        for extra in ("pre_quant_scale", "weight_zero_point", "k_scale", "v_scale", "output_scale"):
            if extra not in _SUFFIXES[name] and self.has(f"{module}.{extra}"):
                raise UnsupportedError(f"{module}.{extra}: {algo} with {extra} is not run by the embedded engine",
                                       where=str(self.path))
        return FORMATS[name], _engine_tensors(name, t, module)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _engine_tensors(name: str, t: dict[str, torch.Tensor], module: str) -> dict[str, torch.Tensor]:
    """A linear's unified-HF tensors (``weight`` [out, in]) as its engine format keys and lays them out."""
    w = t["weight"]
    want = {"fp8": torch.float8_e4m3fn, "fp8_block_wo": torch.float8_e4m3fn, "int8": torch.int8}.get(name, torch.uint8)
    if w.dtype != want or w.dim() != 2:
        raise CheckpointError(f"{module}.weight is {w.dtype} {list(w.shape)}; {name} stores {want} [out, in]")
    if name == "int8":  # W8A16: codes [out, in] and a float32 scale per output channel
        s = t["weight_scale"].float().reshape(-1)
        if s.numel() != w.shape[0]:
            raise CheckpointError(f"{module}.weight_scale has {s.numel()} values for {w.shape[0]} output channels")
        return {"weight": w.t().contiguous(), "per_channel_scale": s.contiguous()}
    out = dict(t)
    if name == "fp8_block_wo":  # ModelOpt squeezes the [ceil(out/128), ceil(in/128)] block scales
        b = FORMATS[name].block
        shape = (-(-w.shape[0] // b), -(-w.shape[1] // b))
        s = t["weight_scale"].float()
        if s.numel() != math.prod(shape):
            raise CheckpointError(f"{module}.weight_scale has {s.numel()} values for {shape[0]} x {shape[1]} blocks")
        out["weight_scale"] = s.reshape(shape).contiguous()
    for k in ("input_scale", "weight_scale_2"):
        if k in out:
            out[k] = out[k].float().reshape(())
    if name == "fp8":
        out["weight_scale"] = out["weight_scale"].float().reshape(())
    return out


# ---- what the engine runs --------------------------------------------------------------------------

class QuantLinear:
    """``x @ W.T`` of a dense linear stored as one or more parts concatenated along the output (q, k, v
    of a fused qkv; up and gate of a shared expert), each in its own format: a quantized part's weight is
    dequantized once (float32, as its format's ``linear`` rebuilds it) and its inputs are quantized as its
    format's kernel does on every call; an unquantized part multiplies the inputs as they are."""

    def __init__(self, parts: list[tuple[QuantFormat | None, dict[str, torch.Tensor]]], device, cpu_matmul: str):
        self.parts = []
        for fmt, t in parts:
            if fmt is None:
                w = t["weight"].to(device, torch.float32)
                self.parts.append((None, None, dense(w, cpu_matmul)))
                continue
            # A pre-quant scale multiplies the inputs before their quantization (W4A8 AWQ), as the
            # format's kernel does; the weight is dequantized without it.
            w = fmt.dequantize({k: v for k, v in t.items() if k != "pre_quant_scale"}, dtype=torch.float32).to(device)
            act = {k: v.to(device) for k, v in t.items() if k in ("input_scale", "pre_quant_scale")}
            self.parts.append((fmt, act, dense(w, cpu_matmul)))
        self.formats = [p[0].name if p[0] is not None else "float" for p in self.parts]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        ys = []
        for fmt, act, w in self.parts:
            xq = xf if fmt is None else fmt.quantize_input(xf, act)
            ys.append(w(xq))
        y = ys[0] if len(ys) == 1 else torch.cat(ys, -1)
        return y.to(x.dtype)


class SplitExperts(ExpertBank):
    """Routed experts whose gate, up and down run as three matrices, each in its own format with its own
    scales (where fusing gate and up into one matrix would change a scale): ``down(silu(gate x) * up x)``
    through each format's ``linear``."""

    def __init__(self, mats: list[tuple[tuple, tuple, tuple]]):
        self.mats = mats  # per expert: ((fmt, packed) of gate, of up, of down)

    def forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        (gf, g), (uf, u), (df, d) = self.mats[e]
        return df.linear(F.silu(gf.linear(x, g)) * uf.linear(x, u), d)

    def format_of(self, e: int) -> str:
        names = {m[0].name for m in self.mats[e]}
        return names.pop() if len(names) == 1 else ",".join(m[0].name for m in self.mats[e])


def fuse_gate_up(fmt: QuantFormat, up: dict[str, torch.Tensor], gate: dict[str, torch.Tensor],
                 up_rows: int) -> dict[str, torch.Tensor] | None:
    """``[up; gate]`` as one matrix of ``fmt`` (engine convention), or None when that would not be
    exactly the two matrices: a per-tensor tensor that differs, or blocks that straddle the seam."""
    if fmt is not None and fmt.out_block and up_rows % fmt.out_block:
        return None
    out = {}
    for k, a in up.items():
        b = gate[k]
        if a.dim() == 0 or k == "pre_quant_scale":  # per-tensor, or per input channel: one for both
            if not torch.equal(a, b):
                return None
            out[k] = a
        elif k == "weight":  # along the output features ([in, out] for the per-channel INT formats)
            out[k] = torch.cat((a, b), fmt.weight_out_axis if fmt is not None else 0)
        else:
            out[k] = torch.cat((a, b), 0)
    return out


def _spec_fields(spec: ModelSpec) -> dict:
    return {f.name: getattr(spec, f.name) for f in fields(ModelSpec)}


def checkpoint_config(ck: UnifiedCheckpoint) -> CheckpointConfig:
    """The engine's model description of a unified-HF checkpoint (one rank: no TensorRT-LLM layout)."""
    dtype = _DTYPES.get(ck.spec.source_dtype)
    if dtype is None:
        raise UnsupportedError(f"model dtype {ck.spec.source_dtype!r} is not one the embedded engine runs",
                               where=str(ck.path / "config.json"), hint="float32, float16 or bfloat16")
    return CheckpointConfig(mapping=Mapping(), dtype=dtype, architecture=ck.adapter.trtllm_architecture,
                            raw={"quant_algo": ck.algo}, **_spec_fields(ck.spec))


def unified_model_config(path: str | Path) -> CheckpointConfig:
    """``checkpoint_config`` of the checkpoint at ``path`` (its quantization config checked too)."""
    ck = UnifiedCheckpoint(path)
    try:
        return checkpoint_config(ck)
    finally:
        ck.close()


class _Loader:
    """Reads one layer's (or the globals') engine tensors through the registry's rules."""

    def __init__(self, ck: UnifiedCheckpoint, cfg: CheckpointConfig, eng: EmbeddedEngine):
        self.ck, self.cfg, self.eng, self.ad = ck, cfg, eng, ck.adapter
        self.dev, self.cdt = eng.device, eng.compute_dtype

    def names(self, rule: Rule, layer: int | None) -> list[str]:
        return [self.ad.name(r, layer) for r in rule.source_roles(self.cfg)]

    def float_tensor(self, rule: Rule, layer: int | None) -> torch.Tensor:
        parts = [self.ck.read(n) for n in self.names(rule, layer)]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, rule.axis)
        if rule.shard == VOCAB:
            t = t[: self.cfg.vocab_size]
        return t

    def tensor(self, rule: Rule, layer: int | None):
        """The rule's engine tensor: a float tensor, or a ``QuantLinear`` when a part is stored quantized."""
        names = self.names(rule, layer)
        is_linear = names[0].endswith(".weight") and rule.kind not in ("norm",)
        if not is_linear or rule.kind == "embedding":
            return self.float_tensor(rule, layer)
        if all(self.ck.algo_of(n[: -len(".weight")]) is None for n in names):
            return self.float_tensor(rule, layer)
        if rule.kind in ("router", "lm_head", "shared_expert_gate"):
            raise UnsupportedError(f"{names[0]} is stored quantized ({self.ck.algo_of(names[0][:-7])}); the embedded "
                                   f"engine runs the {rule.kind.replace('_', ' ')} unquantized", where=str(self.ck.path))
        if len(names) > 1 and rule.axis != 0:
            raise UnsupportedError(f"{rule.name}: quantized parts joined along the input are not supported")
        return QuantLinear([self.ck.linear(n) for n in names], self.dev, self.eng.cpu_matmul)

    def linear(self, t):
        if t is None or isinstance(t, QuantLinear):
            return t
        return dense(t.to(self.dev, self.cdt), self.eng.cpu_matmul)

    def vec(self, t):
        return None if t is None else t.to(self.dev, self.cdt)

    def experts(self, layer: int) -> tuple[ExpertBank, list[int]]:
        """Layer ``layer``'s routed experts, and each expert's stored bytes."""
        c, ad = self.cfg, self.ad
        E, dt = c.num_experts, c.dtype
        mats, nbytes = [], []
        for e in range(E):
            m = []
            size = 0
            for role in ("expert_gate", "expert_up", "expert_down"):
                name = ad.name(role, layer, e)
                fmt, t = self.ck.linear(name)
                size += sum(v.numel() * v.element_size() for v in t.values())
                m.append((fmt, t))
            mats.append(m)
            nbytes.append(size)
        if all(f is None for m in mats for f, _ in m):  # float experts: the engine's float bank
            fc = torch.stack([torch.cat((m[1][1]["weight"], m[0][1]["weight"])) for m in mats])
            proj = torch.stack([m[2][1]["weight"] for m in mats])
            return FloatExperts(fc.to(self.dev, self.cdt), proj.to(self.dev, self.cdt), str(dt).replace("torch.", ""),
                                self.eng.cpu_matmul, self.eng.pack_experts), nbytes
        flt = float_format_for(dt)
        mats = [[(flt, {"weight": t["weight"].to(dt)}) if f is None else (f, t) for f, t in m] for m in mats]
        shards, names = [], []
        I = c.expert_intermediate_size
        for (gf, g), (uf, u), (df, d) in mats:
            fused = fuse_gate_up(uf, u, g, I) if gf is uf else None
            if fused is None:
                move = lambda mm: [[(f, {k: v.to(self.dev) for k, v in t.items()}) for f, t in x] for x in mm]  # noqa: E731
                return SplitExperts(move(mats)), nbytes
            shards.append([PackedShard(uf, {k: v.to(self.dev) for k, v in fused.items()}, df,
                                       {k: v.to(self.dev) for k, v in d.items()})])
            names.append((uf.name, df.name))
        kernels = self.eng.pack_experts and self.eng.cpu_matmul == "auto" and self.dev.type == "cpu"
        return PackedExperts(shards, [n[0] for n in names], [n[1] for n in names], self.eng.cpu_matmul,
                             dt if kernels else None, self.cdt), nbytes


def load_unified_engine(path: str | Path, device: str | torch.device | None = None, max_seq_len: int | None = None,
                        compute_dtype: torch.dtype | None = None, cpu_matmul: str = "auto", pack_experts: bool = True,
                        cpu_activations: str = "float32", weights: str = "compute") -> EmbeddedEngine:
    """The embedded engine running a unified-HF checkpoint directory (arguments as
    ``EmbeddedEngine.from_checkpoint``; its float linears are held in the compute dtype whatever
    ``weights`` says, its quantized ones as their packed bytes)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    ck = UnifiedCheckpoint(path)
    try:
        cfg = checkpoint_config(ck)
        eng = EmbeddedEngine(cfg, device, Path(path), compute_dtype, cpu_matmul, pack_experts, cpu_activations, weights)
        if max_seq_len:
            eng.max_seq_len = max_seq_len
        _fill(eng, ck, cfg)
        leftover = sorted(set(ck.location) - ck.used - _ignored(ck))
        if leftover:
            raise CheckpointError(f"{len(leftover)} tensor(s) the embedded engine would not use, e.g. {leftover[0]!r}",
                                  where=str(ck.path), hint="the checkpoint holds more than its config describes")
    finally:
        ck.close()
    if device.type == "cpu":
        give_back_freed_memory()
    return eng


def _ignored(ck: UnifiedCheckpoint) -> set[str]:
    """Tensors a loader may leave: rotary tables, and a tied model's copy of the embedding as lm_head."""
    out = {n for n in ck.location if n.endswith("rotary_emb.inv_freq")}
    if ck.spec.tie_word_embeddings:
        out.add(ck.adapter.name("lm_head"))
    return out


def _fill(eng: EmbeddedEngine, ck: UnifiedCheckpoint, cfg: CheckpointConfig) -> None:
    ld = _Loader(ck, cfg, eng)
    g = {r.name: ld.tensor(r, None) for r in (*global_rules(cfg, FIRST), *global_rules(cfg, LAST))}
    eng.embedding = ld.vec(g["transformer.vocab_embedding.weight"])
    eng.final_norm, eng.final_norm_b = ld.vec(g["transformer.ln_f.weight"]), ld.vec(g.get("transformer.ln_f.bias"))
    eng.lm_head, eng.lm_head_b = ld.linear(g["lm_head.weight"]), ld.vec(g.get("lm_head.bias"))
    for l in range(cfg.num_layers):
        t = {}
        for r in layer_rules(cfg, l):
            if r.shard == MOE_TP:
                continue
            if r.zeros(cfg):  # a tensor the TensorRT-LLM model has and this model lacks: nothing to add
                continue
            t[r.name] = ld.tensor(r, l)
        same = lambda v: v  # noqa: E731 - the tensors below are already what the engine computes with
        attn = attention_for(cfg, {"q": ld.linear(t["attention.qkv.weight"]), "o": ld.linear(t["attention.dense.weight"]),
                                   "q_bias": ld.vec(t.get("attention.qkv.bias")), "o_bias": ld.vec(t.get("attention.dense.bias")),
                                   "q_norm": ld.vec(t.get("attention.q_layernorm.weight")),
                                   "k_norm": ld.vec(t.get("attention.k_layernorm.weight"))}, same, same)
        lay = Layer(input_norm=ld.vec(t["input_layernorm.weight"]), post_norm=ld.vec(t["post_layernorm.weight"]),
                    attn=attn, input_norm_b=ld.vec(t.get("input_layernorm.bias")),
                    post_norm_b=ld.vec(t.get("post_layernorm.bias")))
        if cfg.moe_layers[l]:
            lay.router = dense(t["mlp.router.weight"].float().to(eng.device), eng.cpu_matmul)
            lay.experts, nbytes = ld.experts(l)
            eng.expert_bytes[l] = torch.tensor(nbytes)
            lay.shared_fc = ld.linear(t.get("mlp.shared_expert.fc.weight"))
            lay.shared_proj = ld.linear(t.get("mlp.shared_expert.proj.weight"))
            lay.shared_gate = ld.linear(t.get("mlp.shared_expert_gate.weight"))
        else:
            lay.dense_gate, lay.dense_up = ld.linear(t["mlp.fc.weight"]), ld.linear(t["mlp.gate.weight"])
            lay.dense_down = ld.linear(t["mlp.proj.weight"])
        eng.layers.append(lay)


__all__ = ["ENGINE_FORMATS", "QuantLinear", "SplitExperts", "UnifiedCheckpoint", "checkpoint_config",
           "fuse_gate_up", "is_unified_checkpoint", "load_unified_engine", "unified_model_config"]
