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
"""

from __future__ import annotations

import heapq
import math
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import InputError
from ..hf.adapters import FIRST, LAST, MOE_TP, global_rules, layer_rules
from ..matmul import CPU_ACTIVATIONS, Dense, check_mode, dense
from ..model.description import NORM_NONE, NORM_SPARSE_MIXER
from ..model.params import count_params
from .alloc import give_back_freed_memory, hold_freed_memory
from .beam import BeamState, Hypothesis
from .checkpoint_reader import CheckpointConfig, RankFiles, load_config, whole
from .experts import STACK_MAX_ROWS, ExpertBank, expert_bytes, load_expert_bank, nonexpert_step_bytes


@dataclass
class SamplingParams:
    """Generation settings. ``temperature == 0`` means greedy."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    end_id: int | None = None
    min_tokens: int = 0
    # Logit processing, in TensorRT-LLM's order: embedding_bias is added, the temperature divides
    # (``greedy_temperature`` for a greedy request: it changes the argmax only through the additive
    # penalties), then every token id seen in the prompt or the generated tokens is penalised:
    # repetition divides a positive logit and multiplies a negative one, presence subtracts once,
    # frequency subtracts once per occurrence. The end id is then masked inside ``min_tokens``, and
    # each bad word's last token is masked when the sequence ends with the rest of the word.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    greedy_temperature: float = 1.0
    bad_words: list[list[int]] = field(default_factory=list)
    embedding_bias: torch.Tensor | None = None  # [vocab] float, added to the logits
    # Record each chosen token's log-probability under the processed distribution (full-vocabulary
    # softmax after the steps above, before top-k/top-p): Sequence.log_probs / cum_log_prob.
    return_log_probs: bool = False
    # TensorRT-LLM's return_context_logits / return_generation_logits: keep the prompt's per-position
    # logits from the prefill (Sequence.context_logits) and each sampled step's raw logits, before any
    # of the steps above, as the sampler received them (Sequence.generation_logits). Neither changes
    # which tokens are chosen, nor takes a row out of the batched greedy argmax.
    return_context_logits: bool = False
    return_generation_logits: bool = False
    # Beam search (trtmoe.runtime.beam, TensorRT-LLM's rules) when beam_width > 1: top_k, top_p and
    # the seed play no part; the temperature scales the log-probs (``greedy_temperature``).
    # ``num_return_beams``: how many of the ranked beams a result returns (default: all).
    beam_width: int = 1
    len_penalty: float = 0.0
    early_stopping: int = 1
    diversity_rate: float = 0.0
    num_return_beams: int | None = None
    stop_words: list[list[int]] = field(default_factory=list)  # beam search's own (each beam's tokens)

    def __post_init__(self) -> None:
        if self.embedding_bias is not None and not isinstance(self.embedding_bias, torch.Tensor):
            self.embedding_bias = torch.as_tensor(self.embedding_bias, dtype=torch.float32).reshape(-1)
        self.bad_words = [[int(t) for t in w] for w in self.bad_words]

    @property
    def processed(self) -> bool:
        """Whether a row needs any of the per-row steps above (it then leaves the batched greedy argmax)."""
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                    or self.bad_words or self.embedding_bias is not None or self.return_log_probs
                    or self.beam_width > 1)

    def validate(self, vocab_size: int) -> None:
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be ≥ 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature < math.inf:  # NaN fails every comparison
            raise InputError(f"temperature must be a finite number ≥ 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be ≥ 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.end_id is not None and not 0 <= self.end_id < vocab_size:
            raise InputError(f"end_id {self.end_id} outside the vocabulary (0..{vocab_size - 1})")
        if not self.repetition_penalty > 0:
            raise InputError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.greedy_temperature < math.inf:
            raise InputError(f"temperature must be a finite number ≥ 0, got {self.greedy_temperature}")
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty", "len_penalty", "diversity_rate"):
            if not math.isfinite(getattr(self, name)):
                raise InputError(f"{name} must be finite, got {getattr(self, name)}")
        for w in self.bad_words:
            if not w or any(not 0 <= int(t) < vocab_size for t in w):
                raise InputError(f"bad word {list(w)} is empty or outside the vocabulary (0..{vocab_size - 1})")
        if self.embedding_bias is not None and tuple(self.embedding_bias.shape) != (vocab_size,):
            raise InputError(f"embedding_bias has shape {list(self.embedding_bias.shape)}; "
                             f"it must have the vocabulary size [{vocab_size}]")
        if self.beam_width < 1:
            raise InputError(f"beam_width must be ≥ 1, got {self.beam_width}")
        if self.beam_width > 1:
            if self.len_penalty < 0 or self.early_stopping < 0 or self.diversity_rate < 0:
                raise InputError("len_penalty, early_stopping and beam_search_diversity_rate must be ≥ 0, got "
                                 f"{self.len_penalty}, {self.early_stopping}, {self.diversity_rate}")
            if self.num_return_beams is not None and not 1 <= self.num_return_beams <= self.beam_width:
                raise InputError(f"num_return_sequences {self.num_return_beams} must be between 1 and the beam "
                                 f"width {self.beam_width} in beam search")


@dataclass
class Sequence:
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    slot: int = -1  # row of the engine's KV pool; -1 once released
    length: int = 0  # tokens held in the KV cache
    kv_capacity: int = 0  # tokens of the pool row reserved for it when it was admitted
    generator: torch.Generator | None = field(default=None, repr=False)
    log_probs: list[float] = field(default_factory=list)  # one per token, when return_log_probs
    cum_log_prob: float = 0.0  # their sum, plus the end id's when generation stopped on it
    context_logits: torch.Tensor | None = field(default=None, repr=False)  # [prompt, vocab] float32
    # One [vocab] float32 row per decoding step (the step that chose the end id included).
    generation_logits: list[torch.Tensor] = field(default_factory=list, repr=False)
    _counts: torch.Tensor | None = field(default=None, repr=False)  # occurrences of each id in history
    _counted: int = 0  # generated tokens already in _counts
    _release: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def last_token(self) -> int:
        return self.tokens[-1] if self.tokens else self.prompt[-1]


@dataclass
class BeamSequence(Sequence):
    """One beam-search request (``params.beam_width`` > 1). Its own cache row holds the prompt during
    the prefill; then each live beam is a ``Sequence`` of its own (``beams``), the first on that row,
    the others on rows forked from it, and every step reorders the rows after the parents the search
    picked. ``tokens`` are the best-ranked beam's so far (at the end: the best result's);
    ``results()`` gives the ranked beams the request returns."""

    beams: list[Sequence] = field(default_factory=list, repr=False)
    state: BeamState | None = field(default=None, repr=False)
    # With return_generation_logits, once finished: [K, steps, vocab] float32, the raw logits of each
    # cache slot's beam at each step (the prompt's last position for the first), in slot order as
    # TensorRT-LLM keeps them (not re-ranked like the results).
    beam_generation_logits: torch.Tensor | None = field(default=None, repr=False)

    def results(self) -> list[Hypothesis]:
        return self.state.result(self.params.num_return_beams or self.params.beam_width)


class _KVPool:
    """Keys and values of every live sequence: per layer one ``[slots, nkv, capacity, hd]`` tensor
    (head-major: each head's history is contiguous, which is what attention reads; a decode step
    writes every sequence's new key with one ``index_copy_`` into the flat ``[slots * nkv *
    capacity]`` rows, one row per sequence and head).

    A sequence holds one slot from its prefill until it finishes (or is garbage-collected, e.g. when
    a cancelled request is dropped). A collected sequence's finalizer runs on whichever thread the
    collector ran in (a server's sender or metrics thread, say), so ``release`` only queues the slot;
    the engine's own thread applies the queue (``drain``) before it takes a slot or runs a step.
    Applied off-thread, an idle pool's clearing once emptied the cache lists under a running
    forward ("list index out of range"). Both dimensions grow on demand (existing rows are copied over),
    so the pool holds at most (active sequences, rounded up to a power of two) x (the longest
    prompt + max_new_tokens seen since the engine was last idle); it is freed when no sequence is
    live. The lowest free slot is reused first, so a steady batch keeps to a contiguous block of
    rows and its step reads the cache as a view instead of a gather.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.num_layers, self.nkv, self.hd = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.slots = 0
        self.capacity = 0
        self._free: list[int] = []
        self.live = 0
        self._released: deque[int] = deque()  # slots released from any thread, applied by drain()

    def _resize(self, slots: int, capacity: int) -> None:
        shape = (slots, self.nkv, capacity, self.hd)
        for kv in (self.k, self.v):
            old = list(kv)
            kv.clear()
            for l in range(self.num_layers):
                # Zeros, not empty: a step reads every row up to its longest sequence, and masked
                # attention weights (0) times uninitialized NaN/Inf bits would still be NaN.
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if old:
                    new[: self.slots, :, : self.capacity] = old[l]
                kv.append(new)
        for i in range(self.slots, slots):
            heapq.heappush(self._free, i)
        self.slots, self.capacity = slots, capacity

    def acquire(self, need: int) -> int:
        """A free slot able to hold ``need`` tokens (the engine's thread)."""
        self.drain()
        slots, cap = self.slots, self.capacity
        if need > cap:
            # Doubling amortizes growth, but never reserve more than 4x what was asked for.
            cap = max(need + (-need) % 64, min(2 * cap, 4 * need))
        if not self._free:
            slots = max(4, 2 * self.slots)
        if (slots, cap) != (self.slots, self.capacity):
            self._resize(slots, cap)
        self.live += 1
        return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        """Give ``slot`` back; any thread (see the class docstring). Takes effect at the next ``drain``."""
        self._released.append(slot)

    def drain(self) -> None:
        """Apply the queued releases (the engine's thread)."""
        released = False
        while self._released:
            heapq.heappush(self._free, self._released.popleft())
            self.live -= 1
            released = True
        if released and self.live == 0:  # idle: give the memory back rather than keep a burst's peak
            self.k.clear()
            self.v.clear()
            self._free.clear()
            self.slots = self.capacity = 0


@dataclass
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    wqkv: Dense  # [q; k; v] rows: one matmul per layer
    wo: Dense
    input_norm_b: torch.Tensor | None = None  # LayerNorm biases
    post_norm_b: torch.Tensor | None = None
    bqkv: torch.Tensor | None = None
    bo: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    router: Dense | None = None  # [E, H] float32
    experts: ExpertBank | None = None
    shared_fc: Dense | None = None  # [2S, H] = [up; gate]
    shared_proj: Dense | None = None
    shared_gate: Dense | None = None  # [1, H]
    dense_gate: Dense | None = None  # TRT mlp.fc (activated)
    dense_up: Dense | None = None  # TRT mlp.gate
    dense_down: Dense | None = None


_RMS_CONSTS: dict[tuple[int, float], tuple[torch.Tensor, torch.Tensor]] = {}


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dt = x.dtype
    if dt == torch.float32 and w.dtype == torch.float32:
        if x.device.type != "cpu" or x.requires_grad:  # one fused op, the same arithmetic
            return F.rms_norm(x, w.shape, w, eps)
        # On CPU F.rms_norm runs these steps (x², its mean as sum / n, + eps, rsqrt, the two
        # products) plus two copies, one dispatch each: the same ops here give bit-identical
        # results in less time (0-d tensor constants: a Python scalar operand costs a wrapper).
        n = x.shape[-1]
        k = _RMS_CONSTS.get((n, eps))
        if k is None:
            k = _RMS_CONSTS[(n, eps)] = (torch.tensor(float(n)), torch.tensor(eps))
        return (x * (x * x).sum(-1, keepdim=True).div_(k[0]).add_(k[1]).rsqrt_()).mul_(w)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dt)


def _sparse_mixer(logits: torch.Tensor, k: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse-mixer routing (inference form): pick the best remaining expert k times; each pick's
    weight is its softmax share among the logits within a relative margin 2·eps of it (the others,
    and earlier picks, masked out)."""
    masked = logits
    ws, idxs = [], []
    for _ in range(k):
        top, idx = masked.max(-1, keepdim=True)
        far = (top - logits) / logits.abs().clamp(min=top) > 2 * eps
        ws.append(masked.masked_fill(far, -math.inf).softmax(-1).gather(-1, idx))
        idxs.append(idx)
        masked = masked.scatter(-1, idx, -math.inf)
    return torch.cat(ws, -1), torch.cat(idxs, -1)


@dataclass(frozen=True)
class RouterOverride:
    """A what-if on routing (``EmbeddedEngine.router_override``): ``top_k`` picks per token instead of
    the model's, router logits divided by ``temperature`` before the model's own normalization, and a
    per-expert capacity of ceil(``capacity_factor`` · tokens · k / experts) picks per forward block:
    as in capacity-limited MoE serving, the tokens of a block claim places in order (row by row,
    position by position, a token's picks best first) and a pick over its expert's capacity is
    dropped (the expert adds nothing for that token; the residual stream passes on)."""

    top_k: int | None = None
    temperature: float = 1.0
    capacity_factor: float | None = None

    def __post_init__(self):
        if self.top_k is not None and self.top_k < 1:
            raise InputError(f"router override top_k must be ≥ 1, got {self.top_k}")
        if not self.temperature > 0:
            raise InputError(f"router temperature must be > 0, got {self.temperature}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise InputError(f"capacity factor must be > 0, got {self.capacity_factor}")

    def keep(self, idx: torch.Tensor, num_experts: int) -> torch.Tensor | None:
        """[N, k] bool: the picks within their expert's capacity (None: no capacity limit)."""
        if self.capacity_factor is None:
            return None
        n, k = idx.shape
        cap = math.ceil(self.capacity_factor * n * k / num_experts)
        flat = idx.reshape(-1)
        # Each pick's place in its expert's queue: how many earlier picks chose the same expert.
        place = F.one_hot(flat, num_experts).cumsum(0).gather(1, flat[:, None]).squeeze(1)
        return (place <= cap).view(n, k)



class EmbeddedEngine:
    """Runs a TensorRT-LLM checkpoint directory with PyTorch."""

    def __init__(self, cfg: CheckpointConfig, device: torch.device, path: Path | None = None,
                 compute_dtype: torch.dtype | None = None, cpu_matmul: str = "auto", pack_experts: bool = True,
                 cpu_activations: str = "float32"):
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
        if device.type == "cpu":
            hold_freed_memory()  # the activations' memory is reused, not faulted in again (runtime/alloc.py)
        self.layers: list[_Layer] = []
        self.embedding: torch.Tensor | None = None
        self.final_norm: torch.Tensor | None = None
        self.final_norm_b: torch.Tensor | None = None
        self.lm_head: Dense | None = None
        self.lm_head_b: torch.Tensor | None = None
        hd = cfg.head_dim
        expo = cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd)
        self._inv_freq = (1.0 / expo).to(device)
        self._rope_sign = torch.cat((-torch.ones(hd // 2), torch.ones(hd // 2))).to(device)
        lr = cfg.longrope
        if lr is not None:  # (inverse frequencies, cos/sin scale) for short and long contexts
            self._longrope = tuple((1.0 / (torch.tensor(lr[f"{n}_factor"], dtype=torch.float32) * expo)).to(device)
                                   for n in ("short", "long"))
            self._mscale = (lr["short_mscale"], lr["long_mscale"])
        self._rope_cache: dict[tuple[bool, torch.dtype], torch.Tensor] = {}
        self.max_seq_len = cfg.max_position_embeddings
        L, E = cfg.num_layers, cfg.num_experts
        self._kv = _KVPool(L, cfg.num_kv_heads, hd, compute_dtype, device)
        self._counts = torch.zeros(L, E, dtype=torch.int64, device=device)
        self._entropy = torch.zeros(L, dtype=torch.float64, device=device)
        self._mass = torch.zeros(L, E, dtype=torch.float64, device=device)
        self._tokens = 0
        # Decode steps' traffic (see ``decode_traffic``): steps, rows, the steps in which each expert
        # was read [L, E], and the KV-cache bytes read; the weights' bytes follow from these.
        self._dec_steps = self._dec_rows = self._dec_kv_bytes = 0
        self._dec_touched = torch.zeros(L, E, dtype=torch.int64, device=device)
        self._pending_decode: list[bool] = []
        self.expert_bytes = torch.zeros(L, E, dtype=torch.int64)  # checkpoint bytes of each expert (load)
        self.nonexpert_bytes = nonexpert_step_bytes(cfg)
        self._kv_token_bytes = 2 * L * cfg.num_kv_heads * hd * torch.empty((), dtype=compute_dtype).element_size()
        self._layer_ids: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        # Small blocks' (decode steps') routing records wait here and are added in batches (see
        # ``_record_routing``); the lock guards them, the totals and ``_tokens`` against a reader in
        # another thread (``routing_stats``, e.g. a metrics thread).
        self._pending: list[list[tuple]] = []
        self._pending_elems = 0
        self._stats_lock = threading.Lock()
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
                        cpu_activations: str = "float32") -> "EmbeddedEngine":
        """Load a TensorRT-LLM checkpoint directory (config.json + rank*.safetensors).

        ``device``: None = CUDA when present, else CPU. ``compute_dtype``: activation dtype, by
        default float32 on CPU and the checkpoint dtype on CUDA. ``cpu_matmul``: "auto" or "blas"
        (see trtmoe.matmul). ``pack_experts=False`` keeps every routed expert's plain weights (with
        "auto" on CPU, large float expert matrices are otherwise held only packed for oneDNN, and
        INT8 / INT4 ones of a 16-bit model only in PyTorch's CPU weight-only kernels' layouts, see
        trtmoe.runtime.qkernels) and runs quantized experts on their formats' reference path.
        ``cpu_activations``: "float32" (the default on CPU) or "model" (the checkpoint's dtype, as on
        CUDA; ignored where ``compute_dtype`` is given)."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        cfg = load_config(ckpt_dir)
        eng = cls(cfg, device, Path(ckpt_dir), compute_dtype, cpu_matmul, pack_experts, cpu_activations)
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
        c, mp = self.cfg, self.cfg.mapping
        dev, cdt = self.device, self.compute_dtype
        to = lambda t: None if t is None else t.to(dev, cdt)  # noqa: E731
        lin = lambda t: dense(to(t), self.cpu_matmul)  # noqa: E731
        g = {r.name: whole(files, r, "", 0) for r in global_rules(c, FIRST)}
        g.update({r.name: whole(files, r, "", mp.pp_size - 1) for r in global_rules(c, LAST)})
        self.embedding = to(g["transformer.vocab_embedding.weight"])
        self.final_norm, self.final_norm_b = to(g["transformer.ln_f.weight"]), to(g.get("transformer.ln_f.bias"))
        self.lm_head, self.lm_head_b = lin(g["lm_head.weight"]), to(g.get("lm_head.bias"))
        for l in range(c.num_layers):
            p, j = mp.layer_owner(c.num_layers, l)
            pre = f"transformer.layers.{j}."
            # Tensors the target model has but the source did not are zeros: nothing to add.
            t = {r.name: whole(files, r, pre, p) for r in layer_rules(c, l) if r.shard != MOE_TP and not r.zeros(c)}
            lay = _Layer(input_norm=to(t["input_layernorm.weight"]), post_norm=to(t["post_layernorm.weight"]),
                         wqkv=lin(t["attention.qkv.weight"]), wo=lin(t["attention.dense.weight"]),
                         input_norm_b=to(t.get("input_layernorm.bias")), post_norm_b=to(t.get("post_layernorm.bias")),
                         bqkv=to(t.get("attention.qkv.bias")), bo=to(t.get("attention.dense.bias")),
                         q_norm=to(t.get("attention.q_layernorm.weight")),
                         k_norm=to(t.get("attention.k_layernorm.weight")))
            if c.moe_layers[l]:
                lay.router = dense(t["mlp.router.weight"].float().to(dev), self.cpu_matmul)
                lay.experts = load_expert_bank(files, c, l, pre, p, dev, cdt, self.cpu_matmul, self.pack_experts)
                self.expert_bytes[l] = torch.tensor(expert_bytes(c, l))
                lay.shared_fc = lin(t.get("mlp.shared_expert.fc.weight"))  # [up; gate]
                lay.shared_proj = lin(t.get("mlp.shared_expert.proj.weight"))
                lay.shared_gate = lin(t.get("mlp.shared_expert_gate.weight"))
            else:
                lay.dense_gate, lay.dense_up = lin(t["mlp.fc.weight"]), lin(t["mlp.gate.weight"])
                lay.dense_down = lin(t["mlp.proj.weight"])
            self.layers.append(lay)

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
        with self._stats_lock:
            self._flush_routing()
            return {"counts": self._counts.to("cpu", copy=True), "entropy_sum": self._entropy.to("cpu", copy=True),
                    "tokens": self._tokens, "weight_mass": self._mass.to("cpu", copy=True),
                    "decode": self._decode_totals()}

    def _decode_totals(self) -> dict:
        touched = self._dec_touched.to("cpu", copy=True)
        return {"steps": self._dec_steps, "rows": self._dec_rows, "touched": touched,
                "distinct_sum": touched.sum(-1), "expert_bytes": int((touched * self.expert_bytes).sum()),
                "nonexpert_bytes": self._dec_steps * self.nonexpert_bytes[0] + self._dec_rows * self.nonexpert_bytes[1],
                "kv_bytes": self._dec_kv_bytes}

    def decode_traffic(self) -> dict:
        """Cumulative traffic of the decode steps since load (or the last reset): ``steps``, ``rows``
        (tokens decoded), ``touched`` [L, E] (steps in which each expert was read), ``distinct_sum``
        [L] (distinct experts read, summed over steps), and the bytes read: ``expert_bytes`` (each
        touched expert once per step, at its checkpoint format's size: packed weights and scales),
        ``nonexpert_bytes`` (every other weight once per step, one embedding row per token, at the
        checkpoint's sizes) and ``kv_bytes`` (each row's cached keys and values, as this engine holds
        them). See ``decode_summary`` for per-step figures."""
        with self._stats_lock:
            self._flush_routing()
            return self._decode_totals()

    def reset_routing_stats(self) -> None:
        with self._stats_lock:
            self._pending.clear()
            self._pending_decode.clear()
            self._dec_touched.zero_()
            self._dec_steps = self._dec_rows = self._dec_kv_bytes = 0
            self._pending_elems = 0
            self._counts.zero_()
            self._entropy.zero_()
            self._mass.zero_()
            self._tokens = 0

    # ---- the model --------------------------------------------------------------------------------
    def _rope_tables(self, pos: torch.Tensor, dtype: torch.dtype, n_pos: int,
                     lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, 1, hd] for positions pos [B, T] (gpt-neox halves), all below ``n_pos``;
        shared by all layers. They are rows of per-position tables computed once (element by
        element the same float32 arithmetic as computing them for the step's positions).

        LongRoPE picks the short or long factors per sequence: long once the sequence (``lengths``,
        its tokens so far including this forward's; ``n_pos`` for every row when not given) is
        longer than original_max_position_embeddings, so a row never depends on its batch."""
        lr = self.cfg.longrope
        if lr is None:
            return self._rope_rows(False, pos, dtype, n_pos)
        orig = lr["original_max_position_embeddings"]
        longs = [n > orig for n in (lengths if lengths is not None else [n_pos])]
        if all(longs) or not any(longs):
            return self._rope_rows(longs[0], pos, dtype, n_pos)
        pick = torch.tensor(longs, device=pos.device)[:, None, None, None]
        (cs, ss), (cl, sl) = (self._rope_rows(k, pos, dtype, n_pos) for k in (False, True))
        return torch.where(pick, cl, cs), torch.where(pick, sl, ss)

    def _rope_rows(self, long: bool, pos: torch.Tensor, dtype: torch.dtype, n_pos: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        tab = self._rope_cache.get((long, dtype))
        if tab is None or tab.shape[0] < n_pos:
            tab = self._rope_table(long, max(n_pos, min(2 * (0 if tab is None else tab.shape[0]), self.max_seq_len), 256),
                                   dtype)
            self._rope_cache[(long, dtype)] = tab
        cs = tab[pos]  # [B, T, 2, hd]
        return cs[:, :, 0:1], cs[:, :, 1:2]

    def _rope_table(self, long: bool, n: int, dtype: torch.dtype) -> torch.Tensor:
        """[n, 2, hd]: cos and signed sin of positions 0..n-1."""
        inv, scale = self._inv_freq, None
        if self.cfg.longrope is not None:
            inv, scale = self._longrope[long], self._mscale[long]
        freqs = torch.arange(n, device=inv.device).float()[:, None] * inv  # [n, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        # The sine's first half negated: rotate_half(x) * sin == x.roll(hd/2) * signed sin, exactly.
        cos, sin = emb.cos(), emb.sin() * self._rope_sign
        if scale is not None:
            cos, sin = cos * scale, sin * scale
        return torch.stack((cos.to(dtype), sin.to(dtype)), 1)

    @staticmethod
    def _rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [B, T, heads, hd] rotated by the step's tables (gpt-neox halves: x * cos +
        rotate_half(x) * sin, rotate_half(x) = [-x2, x1], with the sign carried by ``sin``)."""
        cos, sin = rope
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin

    def _moe(self, li: int, lay: _Layer, x: torch.Tensor, valid: torch.Tensor | None = None,
             stats: list | None = None) -> torch.Tensor:
        if valid is not None:  # a padded batch: route and run only the real tokens
            out = torch.zeros_like(x)
            out[valid] = self._moe(li, lay, x[valid], stats=stats)
            return out
        c = self.cfg
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        if self.layer_hook is not None:
            self.layer_hook(li, h)
        logits = lay.router(h if h.dtype == torch.float32 else h.float())
        ov, top_k, keep = self.router_override, c.top_k, None
        if ov is not None:
            top_k = min(ov.top_k or top_k, c.num_experts)
            if ov.temperature != 1.0:
                logits = logits / ov.temperature
        probs = None  # the router probabilities, where routing itself needs them
        if c.normalization_mode == NORM_NONE:
            probs = logits.softmax(-1)
            w, idx = probs.topk(top_k, dim=-1)
        elif c.normalization_mode == NORM_SPARSE_MIXER:
            w, idx = _sparse_mixer(logits, top_k, c.sparse_mixer_epsilon)
        else:
            top, idx = logits.topk(top_k, dim=-1)
            w = top.softmax(-1)
        if ov is not None:
            keep = ov.keep(idx, c.num_experts)
            if keep is not None:
                w = w * keep
        one = h.shape[0] == 1 and not h.requires_grad and stats is not None
        flat_idx = None if one else idx.reshape(-1)
        with torch.no_grad():
            # A small block's statistics are added for every layer together after the forward
            # (expert counts included); a one-token block needs no counts to group by.
            n_e = None if one else torch.bincount(flat_idx, minlength=c.num_experts)
            if stats is None:
                self._record_routing([(li, n_e, logits.softmax(-1) if probs is None else probs, flat_idx, w)])
            else:  # the probabilities of a deferred record are computed when it is added
                stats.append((li, n_e, logits if probs is None else probs, idx, w, probs is None))
            if self.route_hook is not None:
                self.route_hook(li, idx if keep is None else idx.masked_fill(~keep, -1))
        if w.dtype != h.dtype:
            w = w.to(h.dtype)
        if one:
            # One token: its k experts run on it directly, in expert order, each output weighted
            # and summed (the same arithmetic as the grouped path below, without the grouping).
            picks = sorted((e, j) for j, e in enumerate(idx.tolist()[0]))
            ws = w.unbind(1)  # [1] each
            out = None
            for (e, j), y in zip(picks, lay.experts.forward_picks(h, [e for e, _ in picks])):
                y = y * ws[j]
                out = y if out is None else out.add_(y)
            return self._moe_tail(li, lay, h, idx, w, out, shape)
        # Group the (token, pick) pairs by expert with one stable sort, run every expert with
        # tokens over its contiguous block, and add the weighted outputs back in one indexed op
        # (in expert order, as a loop over the experts would).
        order = flat_idx.argsort(stable=True)
        token_of = order // idx.shape[1]
        counts = n_e.tolist()
        w_sorted = w.reshape(-1)[order, None]
        if len(token_of) <= STACK_MAX_ROWS:
            # One token: each of its experts reads it as it is (a [1, H] view, no gathered copy).
            xs = h.expand(len(token_of), h.shape[1]) if h.shape[0] == 1 else h[token_of]
            y = lay.experts.forward_grouped(xs, counts)  # a new tensor: weighted in place (no autograd)
            y = y * w_sorted if y.requires_grad else y.mul_(w_sorted)
            out = torch.zeros_like(h).index_add_(0, token_of, y)
        else:  # a big block (prefill): expert by expert, without a copy of every routed row
            out, start = torch.zeros_like(h), 0
            for e, n in enumerate(counts):
                if n:
                    tok = token_of[start:start + n]
                    out.index_add_(0, tok, lay.experts.forward(e, h[tok]) * w_sorted[start:start + n])
                    start += n
        return self._moe_tail(li, lay, h, idx, w, out, shape)

    def _moe_tail(self, li: int, lay: _Layer, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                  out: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if lay.shared_fc is not None:
            hs = lay.shared_fc(h)
            up, gate = hs.chunk(2, dim=-1)
            s = lay.shared_proj(F.silu(gate) * up)
            if lay.shared_gate is not None:
                s = torch.sigmoid(lay.shared_gate(h)) * s
            out = out + s
        if self.moe_hook is not None:
            self.moe_hook(li, h, idx, w, out)
        return out.reshape(shape)

    # Deferred records are added once they hold this many router values or come from this many blocks
    # (or when the statistics are read or reset): a decode step then adds no tensor ops of its own for
    # them, and a reader (the served model's metrics thread, every 0.5 s) finds at most about 1 ms of
    # them to add while it holds the lock and the GIL that the decode thread needs. On the trained
    # fixture adding costs about 12 µs per block plus 0.035 µs per value however they are grouped;
    # bounded by values alone (65,536), 400 one-token steps waited for the reader and took it 5 ms,
    # a gap in every stream every 0.5 s.
    _PENDING_ELEMS = 1 << 14
    _PENDING_BLOCKS = 64

    def _record_routing(self, recs: list[tuple], tokens: int = 0, decode: int | None = None) -> None:
        """Add routing statistics (layer, expert counts, router probabilities, flat top-k ids,
        top-k weights) of one or more layers; they stay on the engine's device (no host sync).

        A single record (a big block's layer) is added at once. A list of every layer's records of a
        small block (layer, counts, router logits or probabilities, top-k ids, weights, whether the
        third item is logits) is queued, with the block's ``tokens``, and added later together with
        the following blocks': each total receives the same values in the same order as adding the
        blocks one by one would. ``decode``: the block is a decode step whose rows' caches held that
        many tokens in all (the experts it reads are counted, see ``decode_traffic``)."""
        with torch.no_grad():
            if len(recs) == 1 and recs[0][1] is not None and len(recs[0]) == 5:
                li, n_e, probs, flat_idx, w = recs[0]
                with self._stats_lock:
                    self._flush_routing()
                    self._counts[li].add_(n_e)
                    ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
                    self._entropy[li].add_(ent.sum())
                    self._mass[li].index_add_(0, flat_idx, w.reshape(-1).double())
                return
            if any(r[2].requires_grad for r in recs):  # keep no autograd graph alive in the queue
                recs = [r[:2] + (r[2].detach(),) + r[3:4] + (r[4].detach(),) + r[5:] for r in recs]
            with self._stats_lock:
                self._tokens += tokens
                if decode is not None:
                    self._dec_steps += 1
                    self._dec_rows += tokens
                    self._dec_kv_bytes += decode * self._kv_token_bytes
                self._pending.append(recs)
                self._pending_decode.append(decode is not None)
                self._pending_elems += len(recs) * recs[0][2].numel()
                if self._pending_elems >= self._PENDING_ELEMS or len(self._pending) >= self._PENDING_BLOCKS:
                    self._flush_routing()

    def _flush_routing(self) -> None:
        """Add the queued small blocks' records to the totals (the caller holds ``_stats_lock``).
        Consecutive blocks of the same layers, row count and kind go together: per (block, layer)
        the entropy is summed over the block's tokens in float32 as before, and the float64 totals
        receive those sums and the weights in block order."""
        pending, decode = self._pending, self._pending_decode
        if not pending:
            return
        self._pending, self._pending_decode, self._pending_elems = [], [], 0
        run: list[list[tuple]] = []
        flags: list[bool] = []
        for recs, dec in zip(pending, decode):
            if run and (len(recs) != len(run[0]) or any(
                    (a[0], a[2].shape, a[3].shape, a[5]) != (b[0], b[2].shape, b[3].shape, b[5])
                    for a, b in zip(recs, run[0]))):
                self._add_run(run, flags)
                run, flags = [], []
            run.append(recs)
            flags.append(dec)
        self._add_run(run, flags)

    def _add_run(self, run: list[list[tuple]], decode: list[bool] | None = None) -> None:
        key = tuple(r[0] for r in run[0])
        at = self._layer_ids.get(key)
        if at is None:  # the layers, and the offset of each one's experts in [L * E]
            ids = torch.tensor(key, device=self.device)
            at = self._layer_ids[key] = (ids, (ids * self.cfg.num_experts)[:, None])
        ids, off = at
        S, nl = len(run), len(key)
        p = torch.stack([r[2] for recs in run for r in recs])  # [blocks * layers, N, E]
        if run[0][0][5]:
            p = p.softmax(-1)
        ent = -(p * p.clamp_min(1e-30).log()).sum(-1)
        self._entropy.index_add_(0, ids.repeat(S), ent.sum(-1).double())
        flat = (torch.stack([r[3] for recs in run for r in recs]).view(S, nl, -1) + off).view(-1)
        self._counts.view(-1).add_(torch.bincount(flat, minlength=self._counts.numel()))
        self._mass.view(-1).index_add_(0, flat, torch.stack([r[4] for recs in run for r in recs]).view(-1).double())
        if decode and any(decode):
            # The experts each decode step read: a (step, layer, expert) presence count.
            LE = self._counts.numel()
            per_step = flat.view(S, -1) + torch.arange(S, device=flat.device)[:, None] * LE
            hits = torch.bincount(per_step.view(-1), minlength=S * LE).view(S, LE)
            if not all(decode):
                hits = hits[torch.tensor(decode, device=hits.device)]
            self._dec_touched.view(-1).add_((hits > 0).sum(0))

    def _dense(self, lay: _Layer, x: torch.Tensor) -> torch.Tensor:
        return lay.dense_down(F.silu(lay.dense_gate(x)) * lay.dense_up(x))

    def _cache_plan(self, seqs: list[Sequence], pos: torch.Tensor, T: int) -> dict:
        """What every layer's attention needs to write and read the pooled cache for this batch,
        computed once per forward: slots, write positions, the rows to read, and the mask."""
        dev = pos.device
        slots = [s.slot for s in seqs]
        starts = [s.length for s in seqs]
        lens = [a + T for a in starts]
        Lmax = max(lens)
        plan = {"Lmax": Lmax, "slot_t": None, "rows": None}
        # e.g. a batched prefill, or a decode step over sequences of one length
        plan["same_start"] = starts[0] if starts.count(starts[0]) == len(starts) else None
        first = slots[0]
        if slots != list(range(first, first + len(seqs))):  # rows are gathered, not viewed
            plan["slot_t"] = torch.tensor(slots, device=dev)
        else:
            plan["rows"] = slice(first, first + len(seqs))
        if T == 1:
            # Each sequence's new key of head h goes to row (slot * nkv + h) * capacity + length of
            # the flat pool.
            cap, nkv = self._kv.capacity, self._kv.nkv
            plan["write_at"] = torch.tensor([(sl * nkv + h) * cap + a for sl, a in zip(slots, starts)
                                             for h in range(nkv)], device=dev)
            # The one query of each sequence, at its last position, sees exactly its own keys: the
            # causal part of the mask is implied, and sequences of one length need no mask at all.
            plan["mask"] = None if plan["same_start"] is not None else (
                torch.arange(Lmax, device=dev) < torch.tensor(lens, device=dev)[:, None])[:, None, None, :]
            return plan
        key_pos = torch.arange(Lmax, device=dev)
        qpos = pos[:, None, :, None]  # [B, 1, T, 1]
        plan["mask"] = (key_pos[None, None, None, :] <= qpos) & (
            key_pos[None, None, None, :] < torch.tensor(lens, device=dev)[:, None, None, None])
        return plan

    def _attention(self, lay: _Layer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], li: int,
                   seqs: list[Sequence] | None, plan: dict | None) -> torch.Tensor:
        c = self.cfg
        B, T, _ = x.shape
        hd, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
        qkv = lay.wqkv(x)
        if lay.bqkv is not None:
            qkv = qkv + lay.bqkv
        v = qkv[..., (nh + nkv) * hd:].view(B, T, nkv, hd)
        if lay.q_norm is not None:
            q, k = qkv[..., :nh * hd].view(B, T, nh, hd), qkv[..., nh * hd:(nh + nkv) * hd].view(B, T, nkv, hd)
            qk = torch.cat((_rms_norm(q, lay.q_norm, c.norm_eps), _rms_norm(k, lay.k_norm, c.norm_eps)), 2)
        else:
            qk = qkv[..., :(nh + nkv) * hd].view(B, T, nh + nkv, hd)
        qk = self._rope(qk, rope)  # queries and keys rotated in one go
        q, k = qk[:, :, :nh].transpose(1, 2), qk[:, :, nh:]  # q [B, heads, T, hd]; k, v [B, T, heads, hd]
        if seqs is None:  # plain causal forward, no cache
            kk, vv, mask = k, v, None
            causal = True
        else:
            # Append to each sequence's pooled cache, then attend over its own history.
            kp, vp = self._kv.k[li], self._kv.v[li]
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
                o = lay.wo(o.reshape(B, T, nh * hd))
                return o if lay.bo is None else o + lay.bo
        if seqs is None:
            kk, vv = kk.transpose(1, 2), vv.transpose(1, 2)  # [B, heads, L, hd] views
        # Grouped-query heads read their shared KV head in place (no repeated copy of the cache).
        o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=causal and T > 1,
                                           scale=1.0 / math.sqrt(hd), enable_gqa=nh != nkv)
        o = lay.wo(o.transpose(1, 2).reshape(B, T, nh * hd))
        return o if lay.bo is None else o + lay.bo

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
        x = self.embedding[ids] if hidden is None else hidden
        plan = self._cache_plan(seqs, pos, ids.shape[1]) if seqs is not None else None
        lengths = rope_lengths  # each cached sequence's tokens after this forward (padding excluded)
        if seqs is not None and lengths is None:
            T = ids.shape[1]
            lengths = [s.length + (last[b] + 1 if last is not None else T) for b, s in enumerate(seqs)]
        rope = self._rope_tables(pos, x.dtype, plan["Lmax"] if plan is not None else int(pos.max()) + 1, lengths)
        # A small block (a decode step) adds every layer's routing statistics in one go afterwards;
        # a decode step always does, so that the experts it read are counted per step.
        stats = [] if ids.numel() <= STACK_MAX_ROWS or decode is not None else None
        for li in range(start_layer, len(self.layers)):
            lay = self.layers[li]
            if self.residual_hook is not None:
                self.residual_hook(li, x)
            h = self._norm(x, lay.input_norm, lay.input_norm_b)
            x = x + self._attention(lay, h, rope, li, seqs, plan)
            h = self._norm(x, lay.post_norm, lay.post_norm_b)
            x = x + (self._moe(li, lay, h, valid, stats) if lay.router is not None else self._dense(lay, h))
        n = ids.numel() if valid is None else int(valid.sum())
        if stats:  # queued together with its token count: a reader never sees one without the other
            self._record_routing(stats, n, decode)
        else:
            with self._stats_lock:
                self._tokens += n
        if last is not None:
            for b in all_positions or ():
                all_positions[b] = self._head(x[b, : last[b] + 1])
            x = x[torch.arange(x.shape[0], device=x.device), torch.tensor(last, device=x.device)][:, None]
        return self._head(x)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head: hidden states [..., H] -> float32 logits [..., V]."""
        x = self._norm(x, self.final_norm, self.final_norm_b)
        logits = self.lm_head(x)
        if self.lm_head_b is not None:
            logits = logits + self.lm_head_b
        return logits if logits.dtype == torch.float32 else logits.float()

    def _norm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        if self.cfg.norm_kind == "layer":
            return F.layer_norm(x, w.shape, w, b, self.cfg.norm_eps)
        return _rms_norm(x, w, self.cfg.norm_eps)

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
        pool = self._kv
        nbytes = sum(t.numel() * t.element_size() for t in (*list(pool.k), *list(pool.v)))
        return {"slots": pool.slots, "live": pool.live - len(pool._released), "capacity": pool.capacity,
                "bytes": nbytes, "device": str(pool.device)}

    def logits_with_grad(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The full causal forward of ``logits``, recorded by autograd from the embedding output on
        (the weights stay constants, so a backward computes activation gradients only)."""
        ids = input_ids.to(self.device)
        B, T = ids.shape
        pos = torch.arange(T, device=self.device).expand(B, T)
        with torch.inference_mode(False), torch.enable_grad():
            x = self.embedding[ids].detach().requires_grad_()
            return self._forward(ids, pos, None, hidden=x)

    # ---- generation ---------------------------------------------------------------------------
    def _alloc_cache(self, s: Sequence, capacity: int):
        pool = self._kv
        slot = pool.acquire(capacity)
        s.slot = slot
        s.kv_capacity = pool.capacity
        # Freed when the sequence finishes, or when it is dropped unfinished (cancelled request).
        s._release = weakref.finalize(s, pool.release, slot)

    def _free_cache(self, s: Sequence) -> None:
        if s._release is not None:
            s._release()  # a finalize object runs once
            s._release = None
            s.slot = -1
            self._kv.drain()

    def _process(self, s: Sequence, logits: torch.Tensor) -> torch.Tensor:
        """The per-row logit steps of SamplingParams (bias, temperature, penalties, min_tokens,
        bad words) on one row of logits, as a new float tensor."""
        p = s.params
        x = logits.float().clone()
        if p.embedding_bias is not None:
            if p.embedding_bias.device != x.device or p.embedding_bias.dtype != x.dtype:
                p.embedding_bias = p.embedding_bias.to(device=x.device, dtype=x.dtype)  # once per request
            x += p.embedding_bias
        t = p.temperature if p.temperature > 0 else p.greedy_temperature
        if t != 1.0:
            x /= max(t, 1e-6)
        if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            if s._counts is None:
                s._counts = torch.bincount(torch.tensor(s.prompt, dtype=torch.long), minlength=x.numel())
                s._counts = s._counts[: x.numel()].to(x.device)
            if s._counted < len(s.tokens):
                new = torch.tensor(s.tokens[s._counted:], dtype=torch.long, device=x.device)
                s._counts.index_add_(0, new, torch.ones_like(new))
                s._counted = len(s.tokens)
            seen = s._counts > 0
            if p.repetition_penalty != 1.0:
                r = p.repetition_penalty
                x = torch.where(seen, torch.where(x < 0, x * r, x / r), x)
            if p.presence_penalty != 0.0:
                x = x - p.presence_penalty * seen.to(x.dtype)
            if p.frequency_penalty != 0.0:
                x = x - p.frequency_penalty * s._counts.to(x.dtype)
        if p.end_id is not None and len(s.tokens) < p.min_tokens:
            x[p.end_id] = -float("inf")
        if p.bad_words:
            hist = s.prompt + s.tokens
            for w in p.bad_words:
                n = len(w) - 1
                if n == 0 or (n <= len(hist) and hist[len(hist) - n:] == list(w[:n])):
                    x[w[-1]] = -float("inf")
        return x

    def _sample(self, s: Sequence, logits: torch.Tensor) -> int:
        p = s.params
        if p.processed:
            x = self._process(s, logits)
            if p.temperature == 0:
                tok = int(x.argmax())
            else:
                tok = self._draw(s, x)
            if p.return_log_probs:
                lp = float(torch.log_softmax(x, -1)[tok])
                s.cum_log_prob += lp
                if not (p.end_id is not None and tok == p.end_id and len(s.tokens) >= p.min_tokens):
                    s.log_probs.append(lp)  # the end id is not an output token
            return tok
        logits = logits.float()
        if p.end_id is not None and len(s.tokens) < p.min_tokens:
            logits[p.end_id] = -float("inf")
        if p.temperature == 0:
            return int(logits.argmax())
        return self._draw(s, logits / p.temperature)

    @staticmethod
    def _draw(s: Sequence, logits: torch.Tensor) -> int:
        """Top-k / top-p sampling from temperature-scaled logits."""
        p = s.params
        if p.top_k:
            kth = logits.topk(min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, -float("inf"))
        probs = logits.softmax(-1)
        if p.top_p < 1.0:
            sp, si = probs.sort(descending=True)
            keep = sp.cumsum(0) - sp < p.top_p
            probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
            probs = probs / probs.sum()
        return int(torch.multinomial(probs.cpu(), 1, generator=s.generator))

    def _accept(self, s: Sequence, tok: int) -> None:
        p = s.params
        if p.end_id is not None and tok == p.end_id and len(s.tokens) >= p.min_tokens:
            s.finished, s.finish_reason = True, "stop"
            return
        s.tokens.append(tok)
        if len(s.tokens) >= p.max_new_tokens:
            s.finished, s.finish_reason = True, "length"

    def _finish_if_done(self, s: Sequence) -> None:
        if s.finished:
            self._free_cache(s)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InputError if a request cannot run on this engine."""
        if not prompt_ids:
            raise InputError("empty prompt")
        params.validate(self.vocab_size)
        bad = [t for t in prompt_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise InputError(f"token id {bad[0]} outside the vocabulary (0..{self.vocab_size - 1})")
        need = len(prompt_ids) + params.max_new_tokens
        if need > self.max_seq_len:
            raise InputError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = "
                             f"{need} exceeds the engine's max_seq_len {self.max_seq_len}")

    def _new_sequence(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        self.check_request(prompt_ids, params)
        if params.beam_width > 1:
            return BeamSequence(list(map(int, prompt_ids)), params, state=BeamState(
                params.beam_width, params.end_id, params.len_penalty, params.early_stopping, params.diversity_rate,
                max_length=self.max_seq_len - len(prompt_ids), stop_words=[list(w) for w in params.stop_words]))
        s = Sequence(list(map(int, prompt_ids)), params)
        if params.temperature > 0:
            s.generator = torch.Generator().manual_seed(
                params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        return s

    @torch.inference_mode()
    def start(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Prefill a new sequence and sample its first token."""
        return self.start_many([prompt_ids], [params])[0]

    @torch.inference_mode()
    def start_many(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Sequence]:
        """Prefill several new sequences in one right-padded forward and sample each one's first
        token. Padding is never routed, counted or cached as history. Raises InputError (nothing is
        kept) if any request cannot run; the caller can then start them one by one."""
        if len(prompts) != len(params) or not prompts:
            raise InputError(f"start_many needs one SamplingParams per prompt (got {len(prompts)} prompts, "
                             f"{len(params)} params)")
        seqs = [self._new_sequence(p, sp) for p, sp in zip(prompts, params)]
        lens = [len(s.prompt) for s in seqs]
        # A prompt that occurs more than once (a request's num_return_sequences, clients sending the
        # same prompt) is prefilled once; its other sequences copy that cache row.
        first: dict[tuple[int, ...], int] = {}
        rep = [first.setdefault(tuple(s.prompt), b) for b, s in enumerate(seqs)]
        uniq = [b for b in range(len(seqs)) if rep[b] == b]
        row_of = {b: i for i, b in enumerate(uniq)}
        U, T = len(uniq), max(lens)
        try:
            for s in seqs:
                self._alloc_cache(s, len(s.prompt) + s.params.max_new_tokens)
            ids = torch.zeros(U, T, dtype=torch.long)
            for i, b in enumerate(uniq):
                ids[i, :lens[b]] = torch.tensor(seqs[b].prompt)
            ids = ids.to(self.device)
            pos = torch.arange(T, device=self.device).expand(U, T)
            ulens = [lens[b] for b in uniq]
            valid = None
            if min(ulens) < T:
                valid = torch.arange(T, device=self.device)[None] < torch.tensor(ulens, device=self.device)[:, None]
            # Every cache row starts empty: a causal mask over the padded block is each prompt's own.
            context = {row_of[rep[b]]: None for b, s in enumerate(seqs) if s.params.return_context_logits} or None
            logits = self._forward(ids, pos, [seqs[b] for b in uniq], valid=valid, last=[n - 1 for n in ulens],
                                   all_positions=context)
            if U < len(seqs):
                dups = [b for b in range(len(seqs)) if rep[b] != b]
                self._kv_copy([seqs[b].slot for b in dups], [seqs[rep[b]].slot for b in dups])
                logits = logits[torch.tensor([row_of[rep[b]] for b in range(len(seqs))], device=logits.device)]
        except BaseException:
            for s in seqs:
                self._free_cache(s)
            raise
        for b, s in enumerate(seqs):
            if s.params.return_context_logits:
                s.context_logits = context[row_of[rep[b]]].cpu()
        self._keep_generation_logits(seqs, logits[:, 0])
        greedy = self._greedy_batch(seqs, logits[:, 0])
        for b, s in enumerate(seqs):
            s.length = lens[b]
            if isinstance(s, BeamSequence):
                self._start_beams(s, logits[b, 0])
                continue
            self._accept(s, greedy[b] if greedy[b] is not None else self._sample(s, logits[b, 0]))
            self._finish_if_done(s)
        return seqs

    @torch.inference_mode()
    def step(self, seqs: list[Sequence]) -> list[int]:
        """One batched decode step for each unfinished sequence; returns the new token of each."""
        self._kv.drain()  # slots of sequences collected on other threads since the last step
        live = [s for s in seqs if not s.finished]
        if not live:
            return []
        if any(s.slot < 0 for s in live):
            raise InputError("a sequence whose KV cache was released cannot be stepped")
        # A beam-search request decodes its live beams as rows of the batch.
        rows = [r for s in live for r in (s.beams if isinstance(s, BeamSequence) else (s,))]
        lr = self.cfg.longrope
        for s in rows:
            if lr is not None and s.length == lr["original_max_position_embeddings"]:
                self._rerotate(s)
        logits = self._decode_logits(rows)
        self._keep_generation_logits(rows, logits)
        toks = self._greedy_batch(rows, logits)
        out = []
        b = 0
        for s in live:
            if isinstance(s, BeamSequence):
                n = len(s.beams)
                for r in s.beams:
                    r.length += 1
                self._advance_beams(s, logits[b:b + n])
                b += n
                out.append(s.tokens[-1] if s.tokens else -1)
                continue
            s.length += 1
            tok = toks[b] if toks[b] is not None else self._sample(s, logits[b])
            b += 1
            self._accept(s, tok)
            self._finish_if_done(s)
            out.append(tok)
        return out

    def _decode_logits(self, rows: list[Sequence]) -> torch.Tensor:
        """[len(rows), V] float32 logits of one decode step over ``rows``, in their order.

        A serving batch lists its sequences in arrival order while their slots are reused lowest
        first, so a steady batch usually holds a contiguous block of slots in some other order.
        Such a batch runs in slot order, where every layer reads its keys and values as a view of
        the pool rather than gathering them, and the logits are put back in the caller's order."""
        slots = [s.slot for s in rows]
        block = list(range(min(slots), min(slots) + len(slots)))
        order = None
        if slots != block and sorted(slots) == block:
            order = sorted(range(len(rows)), key=slots.__getitem__)
            rows = [rows[i] for i in order]
        ids_pos = torch.tensor([[s.last_token, s.length] for s in rows], device=self.device)
        logits = self._forward(ids_pos[:, :1], ids_pos[:, 1:], rows,
                               decode=sum(s.length for s in rows) + len(rows))[:, -1]
        if order is None:
            return logits
        # Row i of the caller is row slots[i] - min(slots) of the slot-ordered batch.
        return logits.index_select(0, torch.tensor([sl - block[0] for sl in slots], device=logits.device))

    # ---- beam search ------------------------------------------------------------------------------
    def _beam_log_probs(self, beams: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """[K, V] float32: each beam's log-softmax, then the request's logit steps applied to the
        log-probs over that beam's own history (TensorRT-LLM's order; see trtmoe.runtime.beam)."""
        lp = torch.log_softmax(logits.float(), -1)
        return torch.stack([self._process(r, lp[i]) for i, r in enumerate(beams)])

    def _start_beams(self, s: BeamSequence, logits: torch.Tensor) -> None:
        """After the prefill: fork the prompt's cache row into one row per beam and take the first
        step of the search (only the first beam proposes)."""
        K = s.params.beam_width
        first = Sequence(s.prompt, s.params, slot=s.slot, length=s.length, kv_capacity=s.kv_capacity)
        s.beams = [first]
        try:
            for _ in range(K - 1):  # their rows get the prompt's cache when the first step picks parents
                r = Sequence(s.prompt, s.params, length=s.length)
                self._alloc_cache(r, len(s.prompt) + s.params.max_new_tokens)
                s.beams.append(r)
        except BaseException:
            for r in s.beams[1:]:
                self._free_cache(r)
            self._free_cache(s)
            raise
        s.kv_capacity = sum(r.kv_capacity for r in s.beams)
        s.generation_logits = []  # the prefill's row went here; each slot's rows are kept by its beam
        if s.params.return_generation_logits:
            for r in s.beams:
                r.generation_logits = [logits.detach().to("cpu", torch.float32, copy=True)]
        lp = self._beam_log_probs([first], logits[None])
        self._reorder_beams(s, s.state.advance(lp.expand(K, -1)))

    def _advance_beams(self, s: BeamSequence, logits: torch.Tensor) -> None:
        self._reorder_beams(s, s.state.advance(self._beam_log_probs(s.beams, logits)))

    def _reorder_beams(self, s: BeamSequence, parents: list[int]) -> None:
        """Give beam i the cache row of its parent (a gather, so rows may swap), its tokens and
        history counts; finish the request when the search is done or out of tokens."""
        slots = [r.slot for r in s.beams]
        if parents != list(range(len(parents))):
            self._kv_copy(slots, [slots[p] for p in parents])
        for r, toks in zip(s.beams, s.state.tokens):
            r.tokens = list(toks)
            r._counts, r._counted = None, 0
        best = s.state.result(1)
        s.tokens = list(best[0].tokens) if best else []
        if s.state.done or s.state.all_stopped or s.state.generated >= s.params.max_new_tokens:
            s.finished, s.finish_reason = True, "stop" if s.state.done or s.state.all_stopped else "length"
            res = s.results()
            s.tokens = list(res[0].tokens) if res else []
            s.log_probs = list(res[0].log_probs) if res else []
            s.cum_log_prob = res[0].cum_log_prob if res else 0.0
            if s.params.return_generation_logits:
                s.beam_generation_logits = torch.stack([torch.stack(r.generation_logits) for r in s.beams])
            for r in s.beams:
                self._free_cache(r)
            s.beams = []
            self._free_cache(s)

    def _kv_copy(self, dst: list[int], src: list[int]) -> None:
        """Copy whole cache rows ``src`` onto rows ``dst`` in every layer (sources read first)."""
        pool = self._kv
        d = torch.tensor(dst, device=self.device)
        sidx = torch.tensor(src, device=self.device)
        for kv in (pool.k, pool.v):
            for t in kv:
                t.index_copy_(0, d, t.index_select(0, sidx))

    def _rerotate(self, s: Sequence) -> None:
        """A LongRoPE sequence about to pass original_max_position_embeddings: its cached keys were
        rotated with the short factors, so its history is computed again into its cache row with the
        long ones (the model's own generation drops its cache there and runs the whole sequence),
        and the step's token is then decoded against it like any other. The recomputation adds
        nothing to the routing statistics."""
        with self._stats_lock:
            self._flush_routing()
            saved = (self._counts.clone(), self._entropy.clone(), self._mass.clone(), self._tokens)
        hist = s.prompt + s.tokens[:-1]  # what the cache holds: every token but the one to decode
        n = s.length
        s.length = 0
        ids = torch.tensor([hist], device=self.device)
        self._forward(ids, torch.arange(n, device=self.device)[None], [s], last=[n - 1], rope_lengths=[n + 1])
        s.length = n
        with self._stats_lock:
            self._pending.clear()
            self._pending_decode.clear()
            self._pending_elems = 0
            self._counts.copy_(saved[0])
            self._entropy.copy_(saved[1])
            self._mass.copy_(saved[2])
            self._tokens = saved[3]

    @staticmethod
    def _keep_generation_logits(seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Record this step's raw logits row [V] of each sequence that asked for them (before the
        sampler, which may mask a row in place)."""
        for b, s in enumerate(seqs):
            if s.params.return_generation_logits:
                s.generation_logits.append(logits[b].detach().to("cpu", torch.float32, copy=True))

    @staticmethod
    def _greedy_batch(live: list[Sequence], logits: torch.Tensor) -> list[int | None]:
        """Argmax of every greedy row in one op (None for sampled rows); an end id still inside
        its sequence's ``min_tokens`` is masked out first, as ``_sample`` does."""
        rows = [b for b, s in enumerate(live) if s.params.temperature == 0 and not s.params.processed]
        out: list[int | None] = [None] * len(live)
        if not rows:
            return out
        sub = logits[rows] if len(rows) < len(live) else logits
        for i, b in enumerate(rows):
            p = live[b].params
            if p.end_id is not None and len(live[b].tokens) < p.min_tokens:
                if sub is logits:  # the caller's logits stay as they are
                    sub = logits.clone()
                sub[i, p.end_id] = -float("inf")
        for b, t in zip(rows, sub.argmax(-1).tolist()):
            out[b] = t
        return out

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None,
                 on_token: Callable[[int], None] | None = None) -> list[int]:
        """Generate for one prompt; ``on_token`` is called with each new token id."""
        params = params or SamplingParams()
        s = self.start(prompt_ids, params)
        emitted = 0
        while True:
            if on_token:
                for t in s.tokens[emitted:]:
                    on_token(t)
            emitted = len(s.tokens)
            if s.finished:
                return list(s.tokens)
            self.step([s])


def decode_summary(after: dict, before: dict | None = None, moe_layers: list[int] | None = None) -> dict:
    """Per-step figures of the decode steps between two ``decode_traffic`` snapshots (``before`` None:
    since load): steps, tokens, mean distinct experts read per MoE layer, and bytes read per step."""
    d = {k: after[k] - before[k] for k in ("steps", "rows", "distinct_sum", "expert_bytes", "nonexpert_bytes",
                                           "kv_bytes")} if before is not None else dict(after)
    n = d["steps"]
    layers = moe_layers if moe_layers is not None else list(range(len(d["distinct_sum"])))
    per_layer = {str(l): (float(d["distinct_sum"][l]) / n if n else 0.0) for l in layers}
    per_step = {k: (d[k] / n if n else 0.0) for k in ("expert_bytes", "nonexpert_bytes", "kv_bytes")}
    return {"steps": n, "tokens": d["rows"], "mean_batch": d["rows"] / n if n else 0.0,
            "distinct_experts_per_layer": per_layer,
            "distinct_experts_mean": sum(per_layer.values()) / len(per_layer) if per_layer else 0.0,
            "bytes_per_step": {**per_step, "total": sum(per_step.values())}}
