"""Quality of a quantized checkpoint against its reference, llama.cpp style, on held-out text.

Both checkpoints are run by the embedded engine, so the quantized one executes its experts from
the packed bytes it actually stores: what is measured is the artifact, not a simulation. They run on
the formats' reference numerics (``pack_experts=False``: float32 activations, the weight dequantized
into the model dtype), the numerics calibration's predictions use, not a CPU kernel's 16-bit
roundings (``trtmoe.runtime.qkernels``), so the figures do not depend on the machine.

Per scored position (every position of every window that has a next token):

* ``KL(p_ref ‖ p_q)`` over the full vocabulary, nats: mean ± stderr, median, 99 %, 99.9 %, max;
* same top-1 token (greedy agreement), %;
* Δp of the reference's top-1 token (``p_q(t*) − p_ref(t*)``), its RMS; and Δp of the actual
  next token (llama.cpp's definition) for comparison;
* perplexity of each model on the text and their ratio.

Per MoE layer: the fraction of tokens whose top-k expert *set* is identical in both models (and
the mean Jaccard overlap). Expert slots are mapped back to original expert ids through each
checkpoint's recorded placement, so a permuted checkpoint is compared expert for expert.

Per rank: bytes of the rank files as stored, and as deployed (routed experts counted in their
quantized size, for checkpoints that carry float weights with a weight-only ``quant_algo``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint.layout import packed_at_conversion
from ..data import load_texts, split_texts
from ..errors import InputError
from ..hf.safetensors_io import SafetensorsFile
from ..quant.calibrate import token_batches
from ..quant.plan import FLOAT, format_obj
from ..runtime.checkpoint_reader import load_config
from ..runtime.experts import slot_formats
from ..runtime.load import checkpoint_dir_of, load_engine

__all__ = ["Reference", "evaluate", "compare", "checkpoint_footprint", "expert_format_grid", "matrix_format_grid",
           "placement_of", "kl_summary", "heldout_ids"]


# ---- checkpoint facts -----------------------------------------------------------------------------
def _raw_config(ckpt: str | Path) -> dict:

    ck, _ = checkpoint_dir_of(ckpt)
    return json.loads((ck / "config.json").read_text())


def placement_of(ckpt: str | Path) -> dict[int, list[int]]:
    """Per MoE layer, slot -> original expert id, as recorded by the writer (identity when absent)."""
    raw = _raw_config(ckpt)
    q = (raw.get("trtmoe") or {}).get("quantization") or {}
    return {int(l): [int(x) for x in p] for l, p in (q.get("placement") or {}).items()}


def matrix_format_grid(ckpt: str | Path) -> dict[str, dict[int, list[str]]]:
    """``{"fc": {layer: [...]}, "proj": {layer: [...]}}``: per MoE layer, the format of each *original*
    expert id's fc and proj (slot formats un-permuted); both equal unless the plan is per matrix."""

    ck, _ = _ck(ckpt)
    cfg = load_config(ck)
    perms = placement_of(ck)
    out: dict[str, dict[int, list[str]]] = {"fc": {}, "proj": {}}
    for l in range(cfg.num_layers):
        if not cfg.moe_layers[l]:
            continue
        _, fc, proj = slot_formats(cfg, l)
        perm = perms.get(l, list(range(cfg.num_experts)))
        for mod, slot_fmt in (("fc", fc), ("proj", proj)):
            fs = [""] * cfg.num_experts
            for s, e in enumerate(perm):
                fs[e] = slot_fmt[s]
            out[mod][l] = fs
    return out


def expert_format_grid(ckpt: str | Path) -> dict[int, list[str]]:
    """Per MoE layer, the format of each *original* expert id (slot formats un-permuted). An expert
    whose fc and proj differ (matrix granularity) is shown as ``fc:<format>,proj:<format>``; see
    ``matrix_format_grid`` for the two grids."""
    g = matrix_format_grid(ckpt)
    return {l: [a if a == b else f"fc:{a},proj:{b}" for a, b in zip(fs, g["proj"][l])] for l, fs in g["fc"].items()}


def _ck(ckpt):

    return checkpoint_dir_of(ckpt)


_EXPERT_MARKERS = (".mlp.fc.", ".mlp.proj.", ".mlp.experts.")


def checkpoint_footprint(ckpt: str | Path) -> dict:
    """Bytes per rank and bits per routed-expert weight of a checkpoint.

    ``stored``: rank file sizes on disk. ``deployed``: the same, except that layers whose float
    weights carry a weight-only ``quant_algo`` (which ``trtllm-build`` packs itself) are counted at
    the packed size, scales included; pre-packed experts count as stored.
    ``expert_bpw``: deployed routed-expert bits / routed-expert weights.
    """

    ck, _ = _ck(ckpt)
    cfg = load_config(ck)
    mp = cfg.mapping
    H, I, E = cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts
    I_loc, E_loc = mp.expert_ffn_per_rank(I), mp.experts_per_rank(E)
    scale_bytes = torch.empty((), dtype=cfg.dtype).element_size()
    ranks = []
    total_expert_bits = 0
    for r in mp.ranks():
        path = ck / f"rank{r}.safetensors"
        size = path.stat().st_size
        moe_layers = [l for l in mp.pp_layers(cfg.num_layers, mp.pp_rank(r)) if cfg.moe_layers[l]]
        local = {mp.layer_owner(cfg.num_layers, l)[1]: l for l in moe_layers}
        stored = {l: 0 for l in moe_layers}  # routed-expert bytes in the file, per MoE layer
        f = SafetensorsFile(path)
        try:
            for name, info in f.tensors.items():
                if not name.startswith("transformer.layers.") or not any(m in name for m in _EXPERT_MARKERS):
                    continue
                j = int(name.split(".")[2])
                if j in local and "shared_expert" not in name:
                    stored[local[j]] += info.nbytes
        finally:
            f.close()
        ep = mp.moe_ep_rank(r)
        deployed = dict(stored)
        for l in moe_layers:
            gran, names, _ = slot_formats(cfg, l)  # layer granularity: fc and proj share the format
            if gran == "layer" and names[0] != FLOAT and not packed_at_conversion(names[0]):
                # Float weights under a weight-only quant_algo: the build packs them to this size.
                fmt = format_obj(names[0], cfg.dtype)
                deployed[l] = E_loc * (fmt.weight_bytes(2 * I_loc, H, 1, scale_bytes)
                                       + fmt.weight_bytes(H, I_loc, 1, scale_bytes))
        total_expert_bits += 8 * sum(deployed.values())
        ranks.append({"rank": r, "stored_bytes": size,
                      "deployed_bytes": size - sum(stored.values()) + sum(deployed.values()),
                      "routed_expert_bytes": sum(deployed.values()),
                      "routed_expert_bytes_stored": sum(stored.values())})
    n_weights = sum(cfg.moe_layers) * E * 3 * I * H
    return {"ranks": ranks, "expert_bpw": total_expert_bits / n_weights if n_weights else 0.0,
            "routed_expert_weights": n_weights, "dtype": str(cfg.dtype).replace("torch.", "")}


# ---- statistics -------------------------------------------------------------------------------------
def kl_summary(kl: torch.Tensor) -> dict:
    """llama.cpp's KL statistics of a flat tensor of per-token KL values (nats)."""
    k = kl.double().flatten()
    n = k.numel()
    if n == 0:
        raise InputError("no scored tokens")
    q = torch.quantile(k, torch.tensor([0.5, 0.99, 0.999], dtype=torch.float64)) if n > 1 else k.repeat(3)
    return {"mean": float(k.mean()), "stderr": float(k.std() / math.sqrt(n)) if n > 1 else 0.0,
            "median": float(q[0]), "p99": float(q[1]), "p999": float(q[2]), "max": float(k.max()),
            "min": float(k.min())}


@dataclass
class _Pass:
    """What one model's forward over the evaluation windows leaves behind."""

    logp: list[torch.Tensor] = field(default_factory=list)  # per batch [B, T-1, V] float32
    routes: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # layer -> per batch [B*T, k] original ids


def _run(eng, ids: torch.Tensor, batch_size: int, perms: dict[int, list[int]], keep_logp: bool,
         consumer=None) -> _Pass:
    out = _Pass()
    cur: dict[int, torch.Tensor] = {}

    def hook(layer: int, idx: torch.Tensor) -> None:
        idx = idx.cpu()
        p = perms.get(layer)
        if p is not None:
            idx = torch.tensor(p, dtype=idx.dtype)[idx]  # slot -> original expert id
        cur[layer] = idx.sort(-1).values

    eng.route_hook = hook
    try:
        for bi, b in enumerate(ids.split(batch_size)):
            cur.clear()
            lp = eng.logits(b)[:, :-1].log_softmax(-1).cpu()
            if keep_logp:
                out.logp.append(lp)
                for l, idx in cur.items():
                    out.routes.setdefault(l, []).append(idx)
            if consumer is not None:
                consumer(bi, b, lp, dict(cur))
    finally:
        eng.route_hook = None
    return out


class Reference:
    """The reference model's pass over the evaluation windows, kept so that many quantized
    checkpoints can be compared against it without re-running it."""

    def __init__(self, ref_ckpt: str | Path, ids: torch.Tensor, *, batch_size: int = 8, device: str = "cpu"):

        if ids.dim() != 2 or ids.shape[1] < 2 or ids.shape[0] < 1:
            raise InputError(f"evaluation ids must be [windows, tokens ≥ 2], got {tuple(ids.shape)}")
        self.ckpt, self.ids, self.batch_size, self.device = Path(ref_ckpt), ids, batch_size, device
        t0 = time.perf_counter()
        eng = load_engine(ref_ckpt, device, pack_experts=False)
        self.top_k = eng.cfg.top_k
        self.num_experts = eng.cfg.num_experts
        self.moe_layers = [l for l in range(eng.cfg.num_layers) if eng.cfg.moe_layers[l]]
        self.vocab_size = eng.cfg.vocab_size
        if int(ids.max()) >= self.vocab_size or int(ids.min()) < 0:
            raise InputError(f"evaluation token ids fall outside the vocabulary (0..{self.vocab_size - 1})")
        self._pass = _run(eng, ids, batch_size, placement_of(ref_ckpt), keep_logp=True)
        self.seconds = time.perf_counter() - t0
        tgt = ids[:, 1:]
        nll = []
        for lp, t in zip(self._pass.logp, tgt.split(batch_size)):
            nll.append(-lp.gather(-1, t[..., None]).squeeze(-1))
        self.nll = torch.cat(nll).double()  # [N, T-1]
        self.footprint = checkpoint_footprint(ref_ckpt)

    @property
    def tokens_scored(self) -> int:
        return self.ids.shape[0] * (self.ids.shape[1] - 1)

    def compare(self, quant_ckpt: str | Path, *, name: str | None = None) -> dict:
        """Statistics of ``quant_ckpt`` against this reference (see the module docstring)."""

        t0 = time.perf_counter()
        eng = load_engine(quant_ckpt, self.device, pack_experts=False)
        if eng.cfg.vocab_size != self.vocab_size or eng.cfg.num_experts != self.num_experts or \
                eng.cfg.top_k != self.top_k:
            raise InputError("the quantized checkpoint is not the same model as the reference",
                             where=str(quant_ckpt))
        kl, same, dp_top, dp_tgt, nll_q = [], [], [], [], []
        agree = {l: 0 for l in self.moe_layers}
        jacc = {l: 0.0 for l in self.moe_layers}
        n_route = {l: 0 for l in self.moe_layers}
        ref_routes = self._pass.routes
        targets = self.ids[:, 1:].split(self.batch_size)

        def consume(bi, b, lq, routes):
            lr = self._pass.logp[bi]
            pr = lr.exp()
            kl.append((pr * (lr - lq)).sum(-1).flatten())
            top = lr.argmax(-1)
            same.append((lq.argmax(-1) == top).flatten())
            g = lambda lp, i: lp.gather(-1, i[..., None]).squeeze(-1).exp()  # noqa: E731
            dp_top.append((g(lq, top) - g(lr, top)).flatten())
            t = targets[bi]
            dp_tgt.append((g(lq, t) - g(lr, t)).flatten())
            nll_q.append(-lq.gather(-1, t[..., None]).squeeze(-1).flatten())
            for l in self.moe_layers:
                a, r = routes[l], ref_routes[l][bi]
                agree[l] += int((a == r).all(-1).sum())
                inter = (a[:, :, None] == r[:, None, :]).any(-1).sum(-1).double()
                jacc[l] += float((inter / (2 * self.top_k - inter)).sum())
                n_route[l] += a.shape[0]

        _run(eng, self.ids, self.batch_size, placement_of(quant_ckpt), keep_logp=False, consumer=consume)
        klv = torch.cat(kl)
        same_v = torch.cat(same).double()
        dpt = torch.cat(dp_top).double()
        dpg = torch.cat(dp_tgt).double()
        n = klv.numel()
        p_same = float(same_v.mean())
        ppl_ref = math.exp(float(self.nll.mean()))
        ppl_q = math.exp(float(torch.cat(nll_q).double().mean()))
        fp = checkpoint_footprint(quant_ckpt)
        manifest = _manifest_quant(quant_ckpt)
        layers = {str(l): {"topk_set_agreement": agree[l] / n_route[l], "jaccard": jacc[l] / n_route[l],
                           "tokens": n_route[l]} for l in self.moe_layers}
        return {
            "name": name or Path(quant_ckpt).name,
            "checkpoint": str(quant_ckpt),
            "tokens_scored": n,
            "windows": int(self.ids.shape[0]), "window_tokens": int(self.ids.shape[1]),
            "kl": kl_summary(klv),
            "same_top1": p_same, "same_top1_stderr": math.sqrt(max(p_same * (1 - p_same), 0.0) / n),
            "rms_dp_top1": float(dpt.pow(2).mean().sqrt()), "mean_dp_top1": float(dpt.mean()),
            "rms_dp_target": float(dpg.pow(2).mean().sqrt()), "mean_dp_target": float(dpg.mean()),
            "ppl_ref": ppl_ref, "ppl_quant": ppl_q, "ppl_ratio": ppl_q / ppl_ref,
            "ln_ppl_ratio": math.log(ppl_q / ppl_ref),
            "router": {"layers": layers,
                       "mean_topk_set_agreement": sum(v["topk_set_agreement"] for v in layers.values()) / len(layers)
                       if layers else 1.0,
                       "min_topk_set_agreement": min((v["topk_set_agreement"] for v in layers.values()), default=1.0)},
            "footprint": fp,
            "expert_bpw": fp["expert_bpw"],
            "formats": {str(l): fs for l, fs in expert_format_grid(quant_ckpt).items()},
            "matrix_formats": {mod: {str(l): fs for l, fs in g.items()}
                               for mod, g in matrix_format_grid(quant_ckpt).items()},
            "plan": manifest,
            "seconds": time.perf_counter() - t0,
        }


def _manifest_quant(ckpt) -> dict:
    ck, _ = _ck(ckpt)
    f = ck / "manifest.json"
    if not f.is_file():
        return {}
    q = json.loads(f.read_text()).get("quantization") or {}
    return {k: v for k, v in q.items() if k not in ("placement",)}


def compare(ref: Reference, quant_ckpt: str | Path, **kw) -> dict:
    """``ref.compare(quant_ckpt)``."""
    return ref.compare(quant_ckpt, **kw)


def evaluate(ref_ckpt: str | Path, quant_ckpt: str | Path, ids: torch.Tensor, *, batch_size: int = 8,
             device: str = "cpu") -> dict:
    """Compare ``quant_ckpt`` with ``ref_ckpt`` on token windows ``ids`` [N, T] (held-out text, disjoint
    from calibration). Returns the statistics dict described in the module docstring; KL in nats,
    probabilities and agreements as fractions in [0, 1], bytes as integers."""
    ref = Reference(ref_ckpt, ids, batch_size=batch_size, device=device)
    out = ref.compare(quant_ckpt)
    out["reference"] = {"checkpoint": str(ref_ckpt), "footprint": ref.footprint, "seconds": ref.seconds}
    return out


def heldout_ids(tokenizer, *, samples: int = 64, seq_len: int = 128, path: str | Path | None = None,
                text_field: str = "text") -> torch.Tensor:
    """Evaluation windows [samples, seq_len]: from ``path`` (text file, directory or JSONL) when given,
    else from the corpus's ``heldout`` split (never used for training or calibration)."""

    # Enough text for the windows with a wide margin (a token is a few bytes of Python source).
    texts = load_texts(path, field=text_field) if path is not None else split_texts(
        "heldout", max_bytes=64 * samples * seq_len)
    return token_batches(texts, tokenizer, samples, seq_len)
