"""The embedded engine: a PyTorch runtime that loads a TensorRT-LLM checkpoint directory and runs it.

It is the executable spec of the checkpoint, written from TensorRT-LLM's semantics: fused expert
``fc`` = [up; gate] with swiglu (linear half first), ``proj`` = down; router in float32 with
normalization mode NONE (top-k of softmax), RENORMALIZE (softmax of the top-k logits) or SPARSE_MIXER
(Phi-3.5-MoE: each pick's weight is a softmax over the logits within a relative margin of it);
Qwen2-MoE's shared expert scaled by sigmoid(shared_expert_gate); dense GatedMLP fc = gate, gate = up;
RMSNorm or LayerNorm (with bias) as the architecture says; RoPE, or Phi-3 LongRoPE (short factors and
scale while a forward stays within original_max_position_embeddings, long ones beyond).
The tensors are read through the architecture registry's rules, applied in reverse.

Prefill + decode with a pooled KV cache (one tensor per layer, a slot per live sequence, so a
batched decode step over sequences of different lengths writes and reads every sequence's keys
with one indexed op per layer), greedy or sampled generation, CPU by default or CUDA.

The parts live in their own modules: weights (``layers``), attention kinds (``attention``), router
kinds (``routers``), the MoE layer (``moe``), expert banks (``experts``, ``qkernels``, ``upcast``),
the KV cache (``kvcache``), rotary tables and norms (``rope``, ``norms``), sampling (``sampling``),
batching and beam requests (``batching``, ``beam_request``, ``beam``) and the routing statistics
(``routing_stats``). This module holds the engine and re-exports the public names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..errors import InputError
from ..matmul import CPU_ACTIVATIONS, Dense, check_mode
from ..model.params import count_params
from .alloc import give_back_freed_memory, hold_freed_memory
from .batching import Batching
from .beam_request import BeamSequence
from .checkpoint_reader import CheckpointConfig, RankFiles, load_config
from .experts import STACK_MAX_ROWS, nonexpert_step_bytes
from .kvcache import KVPool, cache_plan
from .kvcache import stats as kv_stats
from .layers import Layer, load_weights
from .moe import dense_mlp, moe_forward
from .norms import norm
from .rope import Rotary
from .routers import RouterOverride, router_for
from .routing_stats import RoutingStats, decode_summary
from .sampling import SamplingParams, Sequence

# How an engine holds its weight matrices (``EmbeddedEngine(weights=...)``).
WEIGHT_MODES = ("compute", "checkpoint")

__all__ = ["BeamSequence", "EmbeddedEngine", "RouterOverride", "SamplingParams", "Sequence", "decode_summary"]


class EmbeddedEngine(Batching):
    """Runs a TensorRT-LLM checkpoint directory with PyTorch."""

    def __init__(self, cfg: CheckpointConfig, device: torch.device, path: Path | None = None,
                 compute_dtype: torch.dtype | None = None, cpu_matmul: str = "auto", pack_experts: bool = True,
                 cpu_activations: str = "float32", weights: str = "compute"):
        self.cfg = cfg
        self.device = device
        self.path = path
        # Which library runs the CPU matrix products: "auto" (MKL, or oneDNN for large products),
        # "blas" (MKL only); see trtmoe.matmul.
        self.cpu_matmul = check_mode(cpu_matmul)
        # Whether large float expert matrices are held only in oneDNN's packed layout and quantized ones
        # in the CPU integer kernels' ("auto" on CPU); False keeps the plain weights readable
        # (calibration reads them) and quantized experts on the reference path.
        self.pack_experts = pack_experts
        self.dtype = cfg.dtype  # the checkpoint's weight dtype
        # Activations: float32 on CPU (the weights keep their exact checkpoint values; on a CPU without
        # native 16-bit products those are emulated and many times slower), the checkpoint dtype on CUDA
        # and, with cpu_activations="model", on CPU too (see trtmoe.matmul for bfloat16 there).
        if cpu_activations not in CPU_ACTIVATIONS:
            raise InputError(f"cpu_activations must be one of {', '.join(CPU_ACTIVATIONS)}, got {cpu_activations!r}")
        if compute_dtype is None:
            compute_dtype = cfg.dtype if device.type == "cuda" or cpu_activations == "model" else torch.float32
        self.compute_dtype = compute_dtype
        # The dtype the embedding and weight matrices are held in: the compute dtype ("compute": products
        # run packed for oneDNN on CPU, at up to 2-3x a 16-bit checkpoint's memory in float32) or the
        # checkpoint's ("checkpoint": each product converts its weight a block at a time, see
        # trtmoe.runtime.upcast). Norms, biases and routers are held as with "compute" either way.
        if weights not in WEIGHT_MODES:
            raise InputError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {weights!r}")
        self.weight_dtype = cfg.dtype if weights == "checkpoint" else compute_dtype
        if device.type == "cpu":
            hold_freed_memory()  # the activations' memory is reused, not faulted in again (runtime/alloc.py)
        self.layers: list[Layer] = []
        self.embedding: torch.Tensor | None = None
        self.final_norm: torch.Tensor | None = None
        self.final_norm_b: torch.Tensor | None = None
        self.lm_head: Dense | None = None
        self.lm_head_b: torch.Tensor | None = None
        self._rotary = Rotary(cfg, device)
        self.router_kind = router_for(cfg)  # trtmoe.runtime.routers
        self.max_seq_len = cfg.max_position_embeddings
        L, E = cfg.num_layers, cfg.num_experts
        self._kv = KVPool(L, cfg.num_kv_heads, cfg.head_dim, compute_dtype, device)
        self.expert_bytes = torch.zeros(L, E, dtype=torch.int64)  # checkpoint bytes of each expert (load)
        self.nonexpert_bytes = nonexpert_step_bytes(cfg)
        kv_token_bytes = 2 * L * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=compute_dtype).element_size()
        self._routing = RoutingStats(L, E, device, kv_token_bytes)
        self.layer_hook: Callable[[int, torch.Tensor], None] | None = None  # sees MoE-layer inputs
        self.residual_hook: Callable[[int, torch.Tensor], None] | None = None  # sees each layer's input
        self.route_hook: Callable[[int, torch.Tensor], None] | None = None  # sees top-k expert ids [N, k]
        # A routing what-if (None: the model's routing); the route hook then sees a dropped pick as -1.
        self.router_override: RouterOverride | None = None
        # Sees each MoE layer's input h [N, H], top-k ids and weights [N, k] and its output [N, H]; under
        # ``logits_with_grad`` the output is a node of the autograd graph (a tensor hook on it receives
        # the gradient with respect to the layer's output).
        self.moe_hook: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None

    # ---- loading ------------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | Path, device: str | torch.device | None = None,
                        max_seq_len: int | None = None, compute_dtype: torch.dtype | None = None,
                        cpu_matmul: str = "auto", pack_experts: bool = True,
                        cpu_activations: str = "float32", weights: str = "compute") -> "EmbeddedEngine":
        """Load a TensorRT-LLM checkpoint directory (config.json + rank*.safetensors).

        ``device``: None = CUDA when present, else CPU. ``compute_dtype``: activation dtype, by
        default float32 on CPU and the checkpoint dtype on CUDA. ``cpu_matmul``: "auto" or "blas"
        (see trtmoe.matmul). ``pack_experts=False`` keeps every routed expert's plain weights (with
        "auto" on CPU, large float expert matrices are otherwise held only packed for oneDNN, and
        INT8 / INT4 ones of a 16-bit model only in PyTorch's CPU weight-only kernels' layouts, see
        trtmoe.runtime.qkernels) and runs quantized experts on their formats' reference path.
        ``cpu_activations``: "float32" (the default on CPU) or "model" (the checkpoint's dtype, as on
        CUDA; ignored where ``compute_dtype`` is given). ``weights``: "compute" holds every weight matrix
        in the compute dtype, "checkpoint" in the checkpoint's (the memory of the checkpoint; see
        trtmoe.runtime.upcast)."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        cfg = load_config(ckpt_dir)
        eng = cls(cfg, device, Path(ckpt_dir), compute_dtype, cpu_matmul, pack_experts, cpu_activations, weights)
        if max_seq_len:
            eng.max_seq_len = max_seq_len
        files = RankFiles(ckpt_dir, cfg)
        try:
            eng._load(files)
        finally:
            files.close()
        if device.type == "cpu":
            give_back_freed_memory()  # the loading temporaries: nothing will reuse them soon
        return eng

    def _load(self, files: RankFiles):
        w = load_weights(files, self.cfg, self.device, self.compute_dtype, self.cpu_matmul, self.pack_experts,
                         self.weight_dtype)
        self.embedding, self.final_norm, self.final_norm_b = w.embedding, w.final_norm, w.final_norm_b
        self.lm_head, self.lm_head_b, self.layers = w.lm_head, w.lm_head_b, w.layers
        for l, nbytes in w.expert_bytes.items():
            self.expert_bytes[l] = torch.tensor(nbytes)

    # ---- facts ----------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    @property
    def num_experts(self) -> int:
        return self.cfg.num_experts

    @property
    def active_params_per_token(self) -> int:
        return count_params(self.cfg).active

    def routing_stats(self) -> dict:
        """Cumulative routing since load: top-k assignment counts [L, E], the sum of per-token router
        entropy (nats) per layer [L], and the number of tokens routed per layer. Safe to call from
        another thread while the engine runs (a consistent snapshot between two forwards' records)."""
        return self._routing.snapshot(self.expert_bytes, self.nonexpert_bytes)

    def decode_traffic(self) -> dict:
        """Cumulative traffic of the decode steps since load (or the last reset): ``steps``, ``rows``
        (tokens decoded), ``touched`` [L, E] (steps in which each expert was read), ``distinct_sum``
        [L] (distinct experts read, summed over steps), and the bytes read: ``expert_bytes`` (each
        touched expert once per step, at its checkpoint format's size: packed weights and scales),
        ``nonexpert_bytes`` (every other weight once per step, one embedding row per token, at the
        checkpoint's sizes) and ``kv_bytes`` (each row's cached keys and values, as this engine holds
        them). See ``decode_summary`` for per-step figures."""
        return self._routing.traffic(self.expert_bytes, self.nonexpert_bytes)

    def reset_routing_stats(self) -> None:
        self._routing.reset()

    # ---- the model --------------------------------------------------------------------------------
    def _moe(self, li: int, lay: Layer, x: torch.Tensor, valid: torch.Tensor | None = None,
             stats: list | None = None) -> torch.Tensor:
        return moe_forward(self, li, lay, x, valid, stats)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, seqs: list[Sequence] | None,
                 start_layer: int = 0, hidden: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                 last: list[int] | None = None, rope_lengths: list[int] | None = None,
                 all_positions: dict[int, torch.Tensor | None] | None = None,
                 decode: int | None = None) -> torch.Tensor:
        """Logits [B, T, V]; with ``last`` (a position per row) only those, [B, 1, V]. ``valid``
        [B, T] marks the real tokens of a right-padded batch: only they are routed and counted.
        ``rope_lengths`` overrides the sequence lengths LongRoPE chooses its factors by.
        ``all_positions`` (with ``last``): rows whose logits at every position up to their ``last``
        are also wanted; each key's value is set to those, [last + 1, V] float32. ``decode``: this is a
        decode step over rows whose caches hold that many tokens in all after it (``decode_traffic``)."""
        x = self._embed(ids) if hidden is None else hidden
        plan = cache_plan(self._kv, seqs, pos, ids.shape[1]) if seqs is not None else None
        lengths = rope_lengths  # each cached sequence's tokens after this forward (padding excluded)
        if seqs is not None and lengths is None:
            T = ids.shape[1]
            lengths = [s.length + (last[b] + 1 if last is not None else T) for b, s in enumerate(seqs)]
        rope = self._rotary.tables(pos, x.dtype, plan["Lmax"] if plan is not None else int(pos.max()) + 1, lengths,
                                   self.max_seq_len)
        # A small block (a decode step) adds every layer's routing statistics in one go afterwards;
        # a decode step always does, so that the experts it read are counted per step.
        stats = [] if ids.numel() <= STACK_MAX_ROWS or decode is not None else None
        for li in range(start_layer, len(self.layers)):
            lay = self.layers[li]
            if self.residual_hook is not None:
                self.residual_hook(li, x)
            h = self._norm(x, lay.input_norm, lay.input_norm_b)
            x = x + lay.attn(h, rope, None if seqs is None else (self._kv.k[li], self._kv.v[li]), seqs, plan)
            h = self._norm(x, lay.post_norm, lay.post_norm_b)
            x = x + (self._moe(li, lay, h, valid, stats) if lay.router is not None else dense_mlp(lay, h))
        n = ids.numel() if valid is None else int(valid.sum())
        if stats:  # queued together with its token count: a reader never sees one without the other
            self._routing.record(stats, n, decode)
        else:
            self._routing.add_tokens(n)
        if last is not None:
            for b in all_positions or ():
                all_positions[b] = self._head(x[b, : last[b] + 1])
            x = x[torch.arange(x.shape[0], device=x.device), torch.tensor(last, device=x.device)][:, None]
        return self._head(x)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding[ids]
        return x if x.dtype == self.compute_dtype else x.to(self.compute_dtype)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head: hidden states [..., H] -> float32 logits [..., V]."""
        x = self._norm(x, self.final_norm, self.final_norm_b)
        logits = self.lm_head(x)
        if self.lm_head_b is not None:
            logits = logits + self.lm_head_b
        return logits if logits.dtype == torch.float32 else logits.float()

    def _norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return norm(x, w, b, self.cfg.norm_kind, self.cfg.norm_eps)

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full causal forward without a cache. input_ids [B, T] -> float32 logits [B, T, V]."""
        ids = input_ids.to(self.device)
        B, T = ids.shape
        pos = torch.arange(T, device=self.device).expand(B, T)
        return self._forward(ids, pos, None)

    @torch.inference_mode()
    def logits_from(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Continue a full causal forward from the residual stream entering ``layer``
        (hidden [B, T, H], as seen by ``residual_hook``) -> float32 logits [B, T, V]."""
        B, T, _ = hidden.shape
        pos = torch.arange(T, device=self.device).expand(B, T)
        return self._forward(torch.zeros(B, T, dtype=torch.long, device=self.device), pos, None,
                             start_layer=layer, hidden=hidden.to(self.device))

    def trim_memory(self) -> bool:
        """Give the memory freed since the engine last ran back to the system (CPU engines hold it
        for reuse while they are busy; see ``trtmoe.runtime.alloc``), the KV cache of sequences
        collected since included. The serving loop calls this, on the engine's thread, once the
        engine has been idle a while; True when something was returned."""
        self._kv.drain()
        return give_back_freed_memory()

    def kv_cache_stats(self) -> dict[str, int | str]:
        """The pooled KV cache now: rows allocated, rows held by live sequences, tokens per row, bytes
        allocated and the device they are on."""
        return kv_stats(self._kv)

    def logits_with_grad(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The full causal forward of ``logits``, recorded by autograd from the embedding output on
        (the weights stay constants, so a backward computes activation gradients only)."""
        ids = input_ids.to(self.device)
        B, T = ids.shape
        pos = torch.arange(T, device=self.device).expand(B, T)
        with torch.inference_mode(False), torch.enable_grad():
            x = self._embed(ids).detach().requires_grad_()
            return self._forward(ids, pos, None, hidden=x)
