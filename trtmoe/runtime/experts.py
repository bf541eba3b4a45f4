"""Routed-expert weights as the engine holds them: one bank per MoE layer.

A bank computes ``expert_e(x) = proj_e(silu(gate_e x) * up_e x)`` for a block of tokens. Float
banks hold the reassembled [up; gate] / down matrices. Quantized banks hold each rank shard's packed
bytes, fc and proj each in its own format, and run from them through that format's own ``linear``
(see ``trtmoe.quant``): with moe_tp > 1 the expert output is the sum over its shards, exactly as the
ranks would compute it. A serving engine on CPU holds the quantized matrices that PyTorch's CPU
weight-only kernels run in those kernels' layouts instead (``trtmoe.runtime.qkernels``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..checkpoint.layout import expert_tensor, packed_at_conversion
from ..errors import CheckpointError, InputError
from ..hf.adapters import expert_rules
from ..matmul import Packed, matmul_for, mm_t, packs, uses_onednn
from ..model.params import count_params
from ..quant.plan import FLOAT, format_obj
from .checkpoint_reader import unshard
from .qkernels import kernel_for
from .upcast import upcast_linear


# Row blocks up to this size (a decode step, a short prompt) may run stacked: a packed bank's busy
# experts in one call per matrix. Bigger ones (prefill, calibration) run one expert at a time, where
# the per-call overhead is small against the work and padding would cost more. (Float banks always
# run one matmul per busy expert: on CPU a padded batched matmul measured slower than that loop.)
STACK_MAX_ROWS = 512


# Multiply-adds that padding may waste per packed-expert call a stacked call saves (about what a
# call's fixed overhead, unpacking included, costs on a CPU core).
_PACKED_CALL_MACS = 1 << 20
# Expert weights a stacked call may materialize at once (packed ones dequantized), bytes: on a
# full-size model a decode step keeps to a few experts per call.
_STACK_BYTES = 64 << 20


def _padding(counts: list[int], experts: list[int], device, row_macs: int, call_macs: int = _PACKED_CALL_MACS
             ) -> tuple[int, list[int], torch.Tensor, torch.Tensor] | None:
    """Which of ``experts`` (ascending) of a block laid out expert by expert with ``counts`` rows
    each to run as one padded stack: (C, chosen, src, dst) where C is the row count every chosen
    expert is padded to (the busiest experts, above C, run on their own), ``src`` the rows of the
    block that belong to the chosen ones and ``dst`` their places in a [len(chosen) * C] layout;
    None when no padding (``row_macs`` multiply-adds a row) is cheaper than the calls it saves."""
    by_count = sorted(experts, key=counts.__getitem__)
    best, rows = -1, 0
    for i, e in enumerate(by_count):  # the i + 1 least loaded, padded to counts[e] rows each
        rows += counts[e]
        if i and counts[e] and (i + 1) * counts[e] - rows <= call_macs * i // max(row_macs, 1):
            best = i
    if best < 0:
        return None
    C, grp = counts[by_count[best]], sorted(by_count[:best + 1])
    starts, acc = [0] * len(counts), 0
    for e, n in enumerate(counts):
        starts[e] = acc
        acc += n
    src = torch.tensor([starts[e] + r for e in grp for r in range(counts[e])], device=device)
    dst = torch.tensor([j * C + r for j, e in enumerate(grp) for r in range(counts[e])], device=device)
    return C, grp, src, dst


class ExpertBank:
    def forward(self, e: int, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def forward_grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every expert over its own block of rows: ``x`` [M, H] holds expert 0's ``counts[0]`` rows,
        then expert 1's, and so on; returns the [M, H] outputs in the same order. Experts with no
        rows cost nothing."""
        ys, start = [], 0
        for e, n in enumerate(counts):
            if n:
                ys.append(self.forward(e, x[start:start + n]))
                start += n
        if not ys:
            return x.clone()
        return ys[0] if len(ys) == 1 else torch.cat(ys)

    def forward_picks(self, x: torch.Tensor, experts: list[int]) -> list[torch.Tensor]:
        """One token ``x`` [1, H] through each of ``experts`` (distinct): their [1, H] outputs, in order."""
        return [self.forward(e, x) for e in experts]

    def format_of(self, e: int) -> str:  # pragma: no cover - interface
        raise NotImplementedError


class FloatExperts(ExpertBank):
    """fc [E, 2I, H] = per expert [up; gate]; proj [E, H, I].

    A plain matrix is held transposed ([E, H, 2I] and [E, I, H], contiguous: what ``x @ w.t()``
    multiplies, read row by row), and ``fc`` / ``proj`` are [E, 2I, H] / [E, H, I] views of them. Out of
    cache (a decode step streams every busy expert's weights) a matmul reads this layout measurably
    faster on CPU than the transposed view of a row-major [2I, H] weight. With ``cpu_matmul`` "auto",
    an expert's large blocks of rows run through oneDNN (``trtmoe.matmul.mm_t``).

    With ``pack`` (and "auto"), a matrix of at least ``PACK_MIN_ELEMS`` elements (fc and proj each
    decide) is held only in oneDNN's packed layout and every product with it runs there (see
    ``trtmoe.matmul``); ``packed`` says so, and the plain ``fc`` / ``proj`` (which calibration reads)
    are then not available.

    With a ``compute_dtype`` other than the weights' (an engine that holds its weights in the
    checkpoint's 16-bit dtype and computes in float32), the matrices stay as stored, row-major, and
    every product converts a block of rows at a time (``trtmoe.runtime.upcast``)."""

    def __init__(self, fc: torch.Tensor, proj: torch.Tensor, fmt: str, cpu_matmul: str = "blas",
                 pack: bool = False, compute_dtype: torch.dtype | None = None):
        self.fmt = fmt
        self._dims = (fc.shape[1], proj.shape[1])  # the fc and proj output widths, 2I and H
        # Activations of another dtype than the weights (held as the checkpoint stores them): every
        # product converts its weight a block at a time (trtmoe.runtime.upcast), nothing is packed.
        self._upcast = compute_dtype is not None and compute_dtype != fc.dtype
        pack = pack and not self._upcast
        self._onednn = uses_onednn(cpu_matmul, fc[0]) and not self._upcast
        self.matmul = matmul_for(cpu_matmul)  # what a quantized stand-in for one of its matrices runs
        # Per matrix kind: the plain [E, out, in] view (None when packed) and each expert's operand
        # (its transposed plain weight, or its Packed weight).
        self._plain: list[torch.Tensor | None] = []
        self._mats: list[list] = []
        for w in (fc, proj):
            if self._upcast:  # row-major as stored: a product converts a block of rows at a time
                self._plain.append(w)
                self._mats.append(list(w.unbind(0)))
            elif pack and packs(cpu_matmul, w[0]):
                self._plain.append(None)
                self._mats.append([Packed(w[e]) for e in range(w.shape[0])])
            else:
                w_t = w.transpose(1, 2).contiguous()
                self._plain.append(w_t.transpose(1, 2))
                self._mats.append(list(w_t.unbind(0)))

    @property
    def packed(self) -> bool:
        """Whether fc or proj is held only packed."""
        return any(p is None for p in self._plain)

    def _plain_view(self, i: int) -> torch.Tensor:
        if self._plain[i] is None:
            raise InputError("this engine holds its routed experts packed for oneDNN, so their plain weights "
                             "are not available", hint="load it with pack_experts=False")
        return self._plain[i]

    @property
    def fc(self) -> torch.Tensor:
        return self._plain_view(0)

    @property
    def proj(self) -> torch.Tensor:
        return self._plain_view(1)

    def _mm(self, i: int, e: int, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        m = self._mats[i][e]
        if isinstance(m, Packed):
            return m(x, out)
        if self._upcast:
            return upcast_linear(x, m, out)
        if x.dim() != 2:
            return x @ m
        return mm_t(x, m, self._onednn, out=out)

    def fc_out(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """``x @ fc[e].T``: expert ``e``'s [up; gate] pre-activations."""
        return self._mm(0, e, x)

    def proj_out(self, e: int, a: torch.Tensor) -> torch.Tensor:
        """``a @ proj[e].T``: expert ``e``'s output from its activations."""
        return self._mm(1, e, a)

    def row_major(self, e: int) -> dict[str, torch.Tensor]:
        """Row-major copies of expert ``e``'s fc and proj, for work that reduces along their rows (the
        int4 searches: a group's amax over the transposed view took 13 ms against 0.3 ms row-major)."""
        return {"fc": self.fc[e].contiguous(), "proj": self.proj[e].contiguous()}

    def forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        up, gate = self.fc_out(e, x).chunk(2, dim=-1)
        return self.proj_out(e, F.silu(gate).mul_(up))

    def forward_grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        # Each busy expert's two matmuls write into its rows of one buffer per matrix, and the
        # activation runs once over all rows: the same per-row arithmetic as ``forward`` expert by
        # expert (the activation's rows are its inner loop either way), with fewer calls.
        if x.requires_grad and torch.is_grad_enabled():  # out= matmuls record no gradient
            return super().forward_grouped(x, counts)
        busy = [e for e, n in enumerate(counts) if n]
        sizes = [counts[e] for e in busy]
        M = x.shape[0]
        if not busy:
            return x.new_empty(0, self._dims[1])
        h = x.new_empty(M, self._dims[0])
        # Each busy expert's rows as views, cut in one call per tensor.
        for e, xe, he in zip(busy, x.split(sizes), h.split(sizes)):
            self._mm(0, e, xe, out=he)
        up, gate = h.chunk(2, dim=-1)
        act = F.silu(gate).mul_(up)
        y = x.new_empty(M, self._dims[1])
        for e, ae, ye in zip(busy, act.split(sizes), y.split(sizes)):
            self._mm(1, e, ae, out=ye)
        return y

    def format_of(self, e: int) -> str:
        return self.fmt


def _float_fc_proj(files, cfg, pre: str, pp_rank: int):
    """Reassemble full per-expert fc/proj from the EP/TP rank shards (the registry's expert rules in
    reverse: EP blocks stacked, moe_tp shards joined role by role)."""
    mp = cfg.mapping
    out = []
    for rule in expert_rules(cfg).values():
        name, axis = pre + rule.name, rule.axis + 1  # dim 0 stacks the experts
        blocks = [unshard([files.get(name, mp.tp_rank_for(t, ep), pp_rank) for t in range(mp.moe_tp_size)],
                          len(rule.roles), axis) for ep in range(mp.moe_ep_size)]
        out.append(blocks[0] if len(blocks) == 1 else torch.cat(blocks))
    return tuple(out)


class PackedShard(NamedTuple):
    """One moe_tp shard of an expert: each matrix with its own format and packed tensors."""

    fc_fmt: object  # trtmoe.quant.formats.QuantFormat
    fc: dict[str, torch.Tensor]
    proj_fmt: object
    proj: dict[str, torch.Tensor]


class KernelShard(NamedTuple):
    """One moe_tp shard of an expert held for the CPU kernels (``trtmoe.runtime.qkernels``): fc and
    proj each a callable ``x -> x @ W.T``, with their formats (for what reports read)."""

    fc_fmt: object
    fc: object
    proj_fmt: object
    proj: object


def _kernel_shard(sh: PackedShard, dtype: torch.dtype, compute_dtype: torch.dtype) -> PackedShard | KernelShard:
    """``sh`` held for the CPU kernels when both its matrices have one, else ``sh`` itself."""
    fc = kernel_for(sh.fc_fmt, sh.fc, dtype, compute_dtype)
    proj = kernel_for(sh.proj_fmt, sh.proj, dtype, compute_dtype) if fc is not None else None
    return sh if proj is None else KernelShard(sh.fc_fmt, fc, sh.proj_fmt, proj)


class _Stack(NamedTuple):
    """Experts whose shard ``t`` shares formats and tensor shapes: their packed tensors stacked along
    a new leading dim, so one ``linear`` call runs any subset of them. A tensor the format keeps
    whole (the pre-quant scale) stays one tensor when every expert holds the same one, and is stacked
    like the rest when they differ (activation-aware INT4 scales each expert's inputs its own way):
    the format multiplies each expert's rows by its own then, exactly as expert by expert."""

    t: int
    experts: list[int]
    fc_fmt: object
    fc: dict[str, torch.Tensor]
    fc_shared: frozenset[str]
    proj_fmt: object
    proj: dict[str, torch.Tensor]
    proj_shared: frozenset[str]
    row_macs: int  # multiply-adds of one row through fc and proj (about: int4 bytes count twice)


def _shared_keys(fmt) -> frozenset[str]:
    # The tensors a format keeps whole (not one per expert) in an [E, ...] stack.
    keys = getattr(fmt, "_shared_keys", None)
    return keys() if keys is not None else frozenset()


def _stack_shards(shards: list[list[PackedShard]]) -> tuple[list[list[PackedShard]], list[_Stack]]:
    """Group expert shards into ``_Stack``s; the per-expert dicts become views of the stacks (the
    packed bytes are held once)."""
    stacks: list[_Stack] = []
    by_key: dict[tuple, list[int]] = {}
    for e, per in enumerate(shards):
        for t, sh in enumerate(per):
            if not isinstance(sh, PackedShard):  # held for the CPU kernels: runs on its own
                continue
            key = (t, sh.fc_fmt, sh.proj_fmt,
                   tuple((k, v.shape, v.dtype, v.device) for k, v in sorted(sh.fc.items())),
                   tuple((k, v.shape, v.dtype, v.device) for k, v in sorted(sh.proj.items())))
            by_key.setdefault(key, []).append(e)
    new = [list(per) for per in shards]
    for key, g in by_key.items():
        t, fc_fmt, proj_fmt = key[:3]
        if len(g) < 2:
            continue
        parts, whole = {}, {}
        for mod, fmt in (("fc", fc_fmt), ("proj", proj_fmt)):
            ds = [getattr(shards[e][t], mod) for e in g]
            # Kept whole: what the format shares and every expert holds equal.
            whole[mod] = frozenset(k for k in _shared_keys(fmt) & ds[0].keys()
                                   if all(torch.equal(ds[0][k], d[k]) for d in ds[1:]))
            parts[mod] = {k: ds[0][k] if k in whole[mod] else torch.stack([d[k] for d in ds]) for k in ds[0]}
        for j, e in enumerate(g):
            views = {mod: {k: v if k in whole[mod] else v[j] for k, v in parts[mod].items()} for mod in parts}
            new[e][t] = PackedShard(fc_fmt, views["fc"], proj_fmt, views["proj"])
        macs = sum(v[0].numel() * (2 if v.dtype in (torch.int8, torch.uint8) else 1)
                   for mod in ("fc", "proj") for k, v in parts[mod].items() if k == "weight")
        stacks.append(_Stack(t, g, fc_fmt, parts["fc"], whole["fc"], proj_fmt, parts["proj"], whole["proj"], macs))
    return new, stacks


def _select(d: dict[str, torch.Tensor], shared: frozenset[str], sel: torch.Tensor | None) -> dict[str, torch.Tensor]:
    if sel is None:
        return d
    return {k: v if k in shared else v.index_select(0, sel) for k, v in d.items()}


class PackedExperts(ExpertBank):
    """Per expert: a list of moe_tp shards (``PackedShard``), fc and proj each in its own format.
    Runs from the packed bytes through each format's own ``linear``.

    Experts that share formats are also held as stacks: ``forward_grouped`` then runs all of a
    stack's experts that have tokens in one ``linear`` call per matrix (their rows padded to the
    busiest one's), so a decode step unpacks each layer's packed bytes in one go instead of once per
    expert. Busy blocks (prefill) keep one call per expert, where padding would cost more.

    With ``kernel_dtype`` (the model's dtype, on CPU; the kernels take bfloat16 and float16 models,
    ``compute_dtype`` the engine's activations), every shard whose matrices a CPU kernel runs is held
    only in the kernel's layout (a ``KernelShard``, see
    ``trtmoe.runtime.qkernels``) and runs expert by expert; the rest keep the packed bytes and the
    reference path. ``kernels`` says whether any shard is held so."""

    def __init__(self, shards: list[list[PackedShard]], fc_names: list[str], proj_names: list[str] | None = None,
                 cpu_matmul: str = "blas", kernel_dtype: torch.dtype | None = None,
                 compute_dtype: torch.dtype = torch.float32):
        if kernel_dtype is not None:
            shards = [[_kernel_shard(sh, kernel_dtype, compute_dtype) for sh in per] for per in shards]
        self.kernels = any(isinstance(sh, KernelShard) for per in shards for sh in per)
        self.shards, self._stacks = _stack_shards(shards)
        self.fc_names = fc_names
        self.proj_names = list(fc_names) if proj_names is None else proj_names
        # Dequantized float32 weights on CPU: a large block of rows may go to oneDNN.
        self.matmul = matmul_for(cpu_matmul)

    def forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        y = None
        for sh in self.shards[e]:
            part = self._shard_forward(sh, x)
            y = part if y is None else y + part
        return y

    def _shard_forward(self, sh: PackedShard | KernelShard, x: torch.Tensor) -> torch.Tensor:
        if isinstance(sh, KernelShard):
            if x.requires_grad and torch.is_grad_enabled():
                raise InputError("this engine holds its quantized experts in CPU kernel layouts, which record no "
                                 "gradient", hint="load it with pack_experts=False")
            up, gate = sh.fc(x).chunk(2, dim=-1)
            return sh.proj(F.silu(gate).mul_(up))
        h = sh.fc_fmt.linear(x, sh.fc, self.matmul)
        up, gate = h.chunk(2, dim=-1)
        return sh.proj_fmt.linear(F.silu(gate) * up, sh.proj, self.matmul)

    def forward_grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        M = x.shape[0]
        if not self._stacks or M > STACK_MAX_ROWS:
            return super().forward_grouped(x, counts)
        starts, acc = [], 0
        for n in counts:
            starts.append(acc)
            acc += n
        busy = [e for e, n in enumerate(counts) if n]
        out = x.new_zeros(M, x.shape[1])
        # Shard by shard, in rank order: each expert's output is the sum of its shards, as in ``forward``.
        for t in range(max(len(self.shards[e]) for e in busy)):
            covered: set[int] = set()
            for st in self._stacks:
                if st.t != t:
                    continue
                # A few experts per call on a large model: their dequantized weights stay bounded.
                per_call = max(1, _STACK_BYTES // max(1, 8 * st.row_macs))
                busy_here = [e for e in st.experts if counts[e]]
                for i in range(0, len(busy_here), per_call):
                    act = busy_here[i:i + per_call]
                    plan = _padding(counts, act, x.device, st.row_macs, _PACKED_CALL_MACS) if len(act) > 1 else None
                    if plan is None:
                        continue
                    self._run_stack(st, x, plan, out)
                    covered.update(plan[1])
            for e in busy:
                if e not in covered and t < len(self.shards[e]):
                    a, b = starts[e], starts[e] + counts[e]
                    out[a:b] += self._shard_forward(self.shards[e][t], x[a:b])
        return out

    def forward_picks(self, x: torch.Tensor, experts: list[int]) -> list[torch.Tensor]:
        # A token's experts of one stack run in one ``linear`` call per matrix on the token itself (as
        # ``forward_grouped`` does, without its padding plan); each output is the sum of its shards.
        ys: dict[int, torch.Tensor] = {}
        for t in range(max(len(self.shards[e]) for e in experts)):
            covered: set[int] = set()
            for st in self._stacks:
                if st.t != t:
                    continue
                here = [e for e in experts if e in st.experts and e not in covered]
                per_call = max(1, _STACK_BYTES // max(1, 8 * st.row_macs))
                for i in range(0, len(here), per_call):
                    act = here[i:i + per_call]
                    if len(act) < 2:
                        continue
                    sel = None if act == st.experts else torch.tensor([st.experts.index(e) for e in act],
                                                                      device=x.device)
                    h = st.fc_fmt.linear(x.expand(len(act), 1, x.shape[-1]), _select(st.fc, st.fc_shared, sel))
                    up, gate = h.chunk(2, dim=-1)
                    y = st.proj_fmt.linear(F.silu(gate) * up, _select(st.proj, st.proj_shared, sel))
                    for e, ye in zip(act, y.unbind(0)):
                        ys[e] = ye if e not in ys else ys[e] + ye
                    covered.update(act)
            for e in experts:
                if e not in covered and t < len(self.shards[e]):
                    part = self._shard_forward(self.shards[e][t], x)
                    ys[e] = part if e not in ys else ys[e] + part
        return [ys[e] for e in experts]

    @staticmethod
    def _run_stack(st: _Stack, x: torch.Tensor, plan, out: torch.Tensor) -> None:
        """The experts ``plan`` chose, of stack ``st``, in one ``linear`` call per matrix; adds into ``out``."""
        C, act, src, dst = plan
        xp = x.new_zeros(len(act) * C, x.shape[1]).index_copy_(0, dst, x.index_select(0, src))
        sel = None if len(act) == len(st.experts) else torch.tensor(
            [st.experts.index(e) for e in act], device=x.device)
        h = st.fc_fmt.linear(xp.view(len(act), C, -1), _select(st.fc, st.fc_shared, sel))
        up, gate = h.chunk(2, dim=-1)
        y = st.proj_fmt.linear(F.silu(gate) * up, _select(st.proj, st.proj_shared, sel))
        out.index_add_(0, src, y.reshape(len(act) * C, -1).index_select(0, dst))

    def formats_of(self, e: int) -> tuple[str, str]:
        """(fc format, proj format) of expert slot ``e``."""
        return self.fc_names[e], self.proj_names[e]

    def format_of(self, e: int) -> str:
        fc, proj = self.formats_of(e)
        return fc if fc == proj else f"fc:{fc},proj:{proj}"


def slot_formats(cfg, layer: int) -> tuple[str, list[str], list[str]]:
    """(granularity, fc format per expert slot, proj format per slot) as recorded by the writer.

    Layers without a recorded format are float: stacked for ``layer`` granularity (and for
    checkpoints without quantization), one tensor set per expert for ``expert`` / ``matrix``."""
    q = (cfg.raw.get("trtmoe") or {}).get("quantization") or {}
    gran = q.get("granularity", "layer")
    floats = ["float"] * cfg.num_experts
    if gran == "matrix":
        mf = q.get("matrix_formats") or {}
        fc, proj = ((mf.get(mod) or {}).get(str(layer)) for mod in ("fc", "proj"))
        if (fc is None) != (proj is None):
            raise CheckpointError(f"config.json records matrix formats of layer {layer} for "
                                  f"{'fc' if fc is not None else 'proj'} only")
        return gran, fc or floats, proj or floats
    if gran not in ("expert", "layer"):
        raise CheckpointError(f"config.json records an unknown quantization granularity {gran!r}",
                              hint="this checkpoint was written by a newer trtmoe")
    fs = (q.get("expert_formats") or {}).get(str(layer))
    if fs is None:
        return gran, floats, list(floats)
    return gran, fs, list(fs)


def expert_bytes(cfg, layer: int) -> list[int]:
    """Bytes each expert slot of ``layer`` stores (fc + proj in their formats: packed weights and
    scales, the whole expert over every rank): what a step that runs the expert reads."""
    _, fc, proj = slot_formats(cfg, layer)
    I, H, dt = cfg.expert_intermediate_size, cfg.hidden_size, cfg.dtype
    scale = torch.empty((), dtype=dt).element_size()
    memo: dict[tuple[str, str], int] = {}
    for pair in zip(fc, proj):
        if pair not in memo:
            memo[pair] = (format_obj(pair[0], dt).weight_bytes(2 * I, H, 1, scale)
                          + format_obj(pair[1], dt).weight_bytes(H, I, 1, scale))
    return [memo[pair] for pair in zip(fc, proj)]


def nonexpert_step_bytes(cfg) -> tuple[int, int]:
    """(bytes of every weight but the routed experts and the embedding table, bytes of one embedding
    row) at the checkpoint's sizes (routers float32): a decode step reads the first once and the
    second once per token."""
    pc = count_params(cfg)
    es = torch.empty((), dtype=cfg.dtype).element_size()
    static = sum(t for name, (t, _) in pc.components.items() if name not in ("routed experts", "embedding"))
    router = pc.components.get("router", (0, 0))[0]
    tied = cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0  # the head reads the table
    return (static - router + tied) * es + router * 4, cfg.hidden_size * es


def load_expert_bank(files, cfg, layer: int, pre: str, pp_rank: int, device,
                     compute_dtype: torch.dtype | None = None, cpu_matmul: str = "blas",
                     pack: bool = False, weight_dtype: torch.dtype | None = None) -> ExpertBank:
    """The routed experts of ``layer``. Float experts are held in ``weight_dtype`` (default: the
    compute dtype) and multiply activations of ``compute_dtype`` (default: the checkpoint's)."""
    gran, fc_names, proj_names = slot_formats(cfg, layer)
    dt = cfg.dtype
    if gran == "layer" and fc_names[0] == FLOAT:
        fc, proj = _float_fc_proj(files, cfg, pre, pp_rank)
        cdt = compute_dtype or dt
        wdt = weight_dtype or cdt
        return FloatExperts(fc.to(device, wdt), proj.to(device, wdt), str(dt).replace("torch.", ""), cpu_matmul,
                            pack, cdt)
    mp = cfg.mapping
    shards: list[list[PackedShard]] = [[] for _ in range(cfg.num_experts)]
    mv = lambda d: {k: v.to(device) for k, v in d.items()}  # noqa: E731
    for ep in range(mp.moe_ep_size):
        for t in range(mp.moe_tp_size):
            r = mp.tp_rank_for(t, ep)
            f = files.file(mp.rank(r, pp_rank))
            for i, slot in enumerate(mp.ep_experts(cfg.num_experts, r)):
                fmts = {"fc": format_obj(fc_names[slot], dt), "proj": format_obj(proj_names[slot], dt)}
                if gran in ("expert", "matrix"):
                    parts = {}
                    for mod in ("fc", "proj"):
                        prefix = expert_tensor(pre, mod, slot=slot)
                        parts[mod] = {n[len(prefix):]: f.read(n) for n in f.tensors if n.startswith(prefix)}
                elif packed_at_conversion(fc_names[slot]):
                    parts = {}
                    for mod in ("fc", "proj"):
                        prefix = expert_tensor(pre, mod)
                        stack = {n[len(prefix):]: f.read(n) for n in f.tensors if n.startswith(prefix)}
                        parts[mod] = fmts[mod].expert(stack, i)
                else:
                    # Float weights with a weight-only quant_algo: quantize each rank shard as
                    # trtllm-build would, then run from the packed bytes.
                    rules = expert_rules(cfg)
                    fc, proj = (f.read(pre + rules[mod].name)[i] for mod in ("fc", "proj"))
                    parts = {"fc": fmts["fc"].quantize(fc, dtype=dt), "proj": fmts["proj"].quantize(proj, dtype=dt)}
                shards[slot].append(PackedShard(fmts["fc"], mv(parts["fc"]), fmts["proj"], mv(parts["proj"])))
    # On CPU a serving engine ("auto", packed experts) runs what it can in the CPU kernels.
    kernels = pack and cpu_matmul == "auto" and torch.device(device).type == "cpu"
    return PackedExperts(shards, list(fc_names), list(proj_names), cpu_matmul, dt if kernels else None,
                         compute_dtype or torch.float32)
