"""Estimates of engine weight memory and KV-cache memory per GPU, computed without a GPU.

Weights come from the checkpoint's rank files: each file's size, except that float Linear weights
which ``trtllm-build`` will quantize itself (weight-only ``W8A16`` / ``W4A16``, per layer for
``MIXED_PRECISION``) are counted at the stored size of the format that algorithm names
(``quant.formats.builder_format``: 8 or 4 bits plus one per-output-channel scale in the model dtype).

KV cache holds ``max_batch_size`` sequences of ``max_seq_len`` tokens:

    kv_bytes(rank) = 2 (K and V) × layers_on_rank × kv_heads_per_rank × head_size × bytes_per_element
                     × max_batch_size × ceil(max_seq_len / tokens_per_block) × tokens_per_block

Activation workspace is not included: it is bounded by ``max_num_tokens`` and TensorRT chooses it at
build time (there is no closed formula); the TensorRT-LLM runtime also sizes its KV pool from free
memory (``kv_cache_free_gpu_memory_fraction``), not from these limits.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import asdict, dataclass, field

from ..console import fmt_bytes
from ..hf.safetensors_io import SafetensorsFile
from ..quant.formats import builder_format
from ..targets import target_for
from .preflight import CheckpointFacts

# TensorRT-LLM's own default exclusions when a checkpoint's exclude_modules is null.
DEFAULT_EXCLUDES = ["*lm_head", "*router", "*vocab_embedding", "*position_embedding", "*block_embedding",
                    "*shared_expert_gate"]
KV_FORMULA = ("2 × layers_on_rank × kv_heads_per_rank × head_size × bytes_per_element × max_batch_size "
              "× max_beam_width × ceil(max_seq_len / tokens_per_block) × tokens_per_block")
EMBEDDED_KV_FORMULA = ("2 × num_layers × num_kv_heads × head_size × bytes_per_element × max_batch_size "
                       "× max_beam_width × max_seq_len")


@dataclass
class RankEstimate:
    """One GPU's share, in bytes."""

    rank: int
    file_bytes: int  # the rank file as stored
    weight_bytes: int  # after trtllm-build's weight-only quantization of float expert weights
    quantized_by_build: list[str]  # tensors trtllm-build quantizes (counted at their quantized size)
    layers: int
    kv_heads: int
    kv_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


@dataclass
class MemoryEstimate:
    """Per-GPU memory estimate (bytes) for a build; ``formula`` says how it was computed."""

    backend: str
    ranks: list[RankEstimate]
    kv_tokens_per_sequence: int  # max_seq_len rounded up to whole KV blocks
    kv_bytes_per_element: int
    max_batch_size: int
    formula: str
    notes: list[str] = field(default_factory=list)

    @property
    def max_total_bytes(self) -> int:
        return max(r.total_bytes for r in self.ranks)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["max_total_bytes"] = self.max_total_bytes
        return d


def _layer_quant_algo(facts: CheckpointFacts, module: str) -> str | None:
    """The weight-only algorithm TensorRT-LLM applies to ``module`` (a name without ``.weight``)."""
    q = facts.config.get("quantization") or {}
    algo = q.get("quant_algo")
    if algo == "MIXED_PRECISION":
        layers = (facts.quant_cfg or {}).get("quantized_layers") or {}
        parent = module.rsplit(".", 1)[0]
        for key, entry in layers.items():
            # MoE fc/proj entries may also be collapsed into one "...mlp" entry.
            if fnmatch.fnmatchcase(module, key) or fnmatch.fnmatchcase(parent, key):
                return (entry or {}).get("quant_algo")
        return None
    excludes = q.get("exclude_modules")
    if excludes is None:
        excludes = DEFAULT_EXCLUDES
    if any(fnmatch.fnmatchcase(module, p) for p in excludes):
        return None
    return algo


def rank_weight_bytes(facts: CheckpointFacts, rank: int) -> tuple[int, int, list[str]]:
    """(file bytes, estimated engine weight bytes, tensors the build quantizes) for one rank file."""
    path = facts.path / f"rank{rank}.safetensors"
    file_bytes = path.stat().st_size
    est = file_bytes
    quantized = []
    with SafetensorsFile(path) as f:
        for name, info in f.tensors.items():
            if not name.endswith(".weight") or len(info.shape) < 2 or not info.dtype.is_floating_point:
                continue
            module = name[: -len(".weight")]
            if module.endswith(("vocab_embedding", "position_embedding")):
                continue  # embeddings are lookups, never weight-only GEMMs
            fmt = builder_format(_layer_quant_algo(facts, module))
            if fmt is None or fmt.shape_problem(*info.shape[-2:]):
                continue  # not quantized by the build (or a matrix the build cannot quantize: counted as stored)
            # [..., out, in]: leading dims stack experts; one scale per output row of each
            stacked = fmt.weight_bytes(info.shape[-2], info.shape[-1], math.prod(info.shape[:-2]), facts.dtype_bytes)
            est += stacked - info.nbytes
            quantized.append(name)
    return file_bytes, est, quantized


def kv_tokens(max_seq_len: int, tokens_per_block: int) -> int:
    """Tokens one sequence reserves in a paged KV cache: whole blocks."""
    return math.ceil(max_seq_len / tokens_per_block) * tokens_per_block


def estimate_memory(facts: CheckpointFacts, build: dict, backend: str) -> MemoryEstimate:
    """Estimate weight and KV-cache bytes per GPU (a target whose ranks are processes of their own:
    ``tensorrt-llm``) or for the one process that holds every rank (``embedded``)."""
    kv_el = 1 if facts.kv_cache_quant_algo in ("FP8", "INT8") else facts.dtype_bytes
    mbs, msl = build["max_batch_size"], build["max_seq_len"]
    beams = int(build.get("max_beam_width", 1) or 1)  # every beam of a request keeps a cache of its own
    mp = facts.mapping
    if target_for(backend).per_rank_memory:
        tokens = kv_tokens(msl, build["tokens_per_block"])
        kvh = mp.kv_heads_per_rank(facts.model.num_kv_heads)
        ranks = []
        for r in mp.ranks():
            fb, wb, q = rank_weight_bytes(facts, r)
            layers = len(mp.pp_layers(facts.model.num_layers, mp.pp_rank(r)))
            kv = 2 * layers * kvh * facts.model.head_dim * kv_el * mbs * beams * tokens
            ranks.append(RankEstimate(r, fb, wb, q, layers, kvh, kv))
        notes = ["activation workspace not included (bounded by max_num_tokens; chosen by TensorRT at build time)"]
        return MemoryEstimate(backend, ranks, tokens, kv_el, mbs, KV_FORMULA, notes)
    # The embedded engine loads every rank into one process and keeps one contiguous cache per sequence.
    fb = wb = 0
    q: list[str] = []
    for r in mp.ranks():
        a, b, qq = rank_weight_bytes(facts, r)
        fb, wb, q = fb + a, wb + b, q + qq
    kv = 2 * facts.model.num_layers * facts.model.num_kv_heads * facts.model.head_dim * kv_el * mbs * beams * msl
    notes = ["weights: sum of all rank files (tensors replicated across ranks counted once per rank, so "
             "an upper bound)", "activations not included"]
    if facts.dtype_bytes == 2 and build.get("device", "auto") != "cuda" and \
            build.get("cpu_activations", "float32") == "float32":
        notes.append("on CPU with cpu_activations float32 (the default) the 16-bit float weights and the KV cache "
                     "are held in float32, up to twice these figures (cpu_activations model keeps the checkpoint's "
                     "dtype; quantized experts stay quantized either way)")
    one = RankEstimate(0, fb, wb, q, facts.model.num_layers, facts.model.num_kv_heads, kv)
    return MemoryEstimate(backend, [one], msl, kv_el, mbs, EMBEDDED_KV_FORMULA, notes)


def render_estimate(est: MemoryEstimate, dtype_name: str) -> list[str]:
    """Human-readable lines; every figure is labelled an estimate and the formula is printed."""
    target = target_for(est.backend)
    lines = [f"ESTIMATE of memory {target.memory_scope} (not measured):"]
    for r in est.ranks:
        q = f", {len(r.quantized_by_build)} float tensor(s) counted at their weight-only size" \
            if r.quantized_by_build else ""
        head = f"  rank {r.rank}: " if target.per_rank_memory else "  "
        src = "rank file" if target.per_rank_memory else "all rank files"
        lines.append(f"{head}weights ≈ {fmt_bytes(r.weight_bytes)} ({src} {fmt_bytes(r.file_bytes)}{q}); "
                     f"KV cache ≈ {fmt_bytes(r.kv_bytes)} ({r.layers} layers × {r.kv_heads} KV heads); "
                     f"total ≈ {fmt_bytes(r.total_bytes)}")
    lines.append(f"  KV cache formula: {est.formula}")
    lines.append(f"    with max_batch_size={est.max_batch_size}, tokens per sequence={est.kv_tokens_per_sequence}, "
                 f"bytes_per_element={est.kv_bytes_per_element} ({dtype_name if est.kv_bytes_per_element > 1 else '8-bit KV'})")
    lines.extend(f"  note: {n}" for n in est.notes)
    return lines
