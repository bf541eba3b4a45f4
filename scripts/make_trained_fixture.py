#!/usr/bin/env python3
"""Train a small MoE fixture (Mixtral-architecture, or with ``--arch qwen3_moe`` a fine-grained
Qwen3-MoE one) and its own byte-level BPE tokenizer.

The model learns Python from the interpreter's own standard library (trtmoe.data's ``train``
split) and is evaluated on the disjoint ``heldout`` split. Training has no load-balancing loss,
so routing is free to skew: later stages measure per-expert quantization error and routing
statistics on this model, and need experts that are rarely chosen.

Reproduce the committed fixtures (about 12 minutes on one CPU thread for the Mixtral one; the
fine-grained Qwen3-MoE one, 64 experts top-8 with hidden size and expert FFN 128 wide, about 10 minutes
of training plus 2 of evaluation):

    python scripts/make_trained_fixture.py --out tests/fixtures/trained_mixtral
    python scripts/make_trained_fixture.py --arch qwen3_moe --out tests/fixtures/trained_qwen3_moe --steps 600

Everything is seeded and single-threaded; the result depends only on the seed, the library
versions recorded in fixture.json and the Python version whose stdlib is the corpus.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

# Rayon (tokenizers) and OpenMP read these at import; one thread keeps runs reproducible.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from trtmoe.data import split_texts  # noqa: E402

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3, Mixtral's unk/bos/eos order
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3

TOKENIZER_HPARAMS = {
    "type": "byte-level BPE",
    "vocab_size": 2048,
    "min_frequency": 2,
    "special_tokens": SPECIAL_TOKENS,
    "adds_bos": True,
}

MODEL_HPARAMS = {
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 512,
    "router_aux_loss_coef": 0.0,
    "output_router_logits": False,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}

# Qwen3-MoE shaped, fine-grained: many small experts, top-8 of 64, renormalized top-k weights, per-head
# q/k RMSNorm; widths a 128-group divides (as Qwen3-30B-A3B's 2048 / 768), so that every int4 kind applies;
# a small vocabulary of its own, so that the committed fixture stays small (about 20 MB).
QWEN3_HPARAMS = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,  # dense FFN width (unused: every layer is MoE)
    "moe_intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 512,
    "router_aux_loss_coef": 0.0,
    "output_router_logits": False,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}

# Deeper and narrower in experts: twelve MoE layers, top-4 of 16. Deployed MoEs have 24-94 layers and
# are quantized one format per layer; with three or four layers a per-layer plan has almost no room
# between budgets (one FP8 layer beside 4-bit ones is already above 5 bits), with twelve it has some.
QWEN3_DEEP_HPARAMS = dict(QWEN3_HPARAMS, num_hidden_layers=12, num_experts=16, num_experts_per_tok=4)

# --arch -> (model hyper-parameters, transformers config and model class names, expert-count and
# top-k keys, default output directory name).
ARCHS = {
    "mixtral": (MODEL_HPARAMS, "MixtralConfig", "MixtralForCausalLM", "num_local_experts", "trained_mixtral"),
    "qwen3_moe": (QWEN3_HPARAMS, "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "num_experts", "trained_qwen3_moe"),
    "qwen3_moe_deep": (
        QWEN3_DEEP_HPARAMS, "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "num_experts", "trained_qwen3_moe_deep"
    ),
}

GENERATION_PROMPTS = ["def ", "import ", "class "]


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int = TOKENIZER_HPARAMS["vocab_size"]):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``; encoding prepends <s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # No prefix space: source text must decode to exactly what was encoded.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=TOKENIZER_HPARAMS["min_frequency"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return tok


def save_tokenizer(tok, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json for AutoTokenizer."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    # The generic class name loads in every transformers release that has AutoTokenizer.
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.setdefault("add_bos_token", True)
    cfg.setdefault("add_eos_token", False)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def token_stream(tok, texts: list[str]) -> torch.Tensor:
    """All texts as one int64 stream, each document framed as <s> ... </s>."""
    parts: list[int] = []
    for enc in tok.encode_batch(texts):  # post-processor already prepends <s>
        parts.extend(enc.ids)
        parts.append(EOS_ID)
    return torch.tensor(parts, dtype=torch.long)


# ---------------------------------------------------------------- model


def build_model(seed: int, router_init_std: float | None, arch: str = "mixtral"):
    import transformers

    hparams, cfg_cls, model_cls = ARCHS[arch][:3]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**hparams)
    model = getattr(transformers, model_cls)(cfg)
    if router_init_std is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, router_init_std)
    return model


def lr_at(step: int, total: int, peak: float, warmup: int, floor_frac: float) -> float:
    """Linear warmup to ``peak``, then cosine decay to ``floor_frac * peak`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (floor_frac + (1 - floor_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model, peak_lr: float, weight_decay: float, router_lr_mult: float):
    decay, no_decay, router = [], [], []
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            router.append(p)
        elif p.ndim >= 2 and "embed_tokens" not in name:
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "lr_mult": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "lr_mult": 1.0},
        {"params": router, "weight_decay": 0.0, "lr_mult": router_lr_mult},
    ]
    return torch.optim.AdamW(groups, lr=peak_lr, betas=(0.9, 0.95), eps=1e-8)


def windows(stream: torch.Tensor, seq_len: int, max_windows: int | None) -> torch.Tensor:
    """Non-overlapping [n, seq_len] windows of ``stream``, evenly spread if capped."""
    n = len(stream) // seq_len
    all_w = stream[: n * seq_len].view(n, seq_len)
    if max_windows is None or n <= max_windows:
        return all_w
    idx = torch.linspace(0, n - 1, max_windows).round().long()
    return all_w[idx]


@torch.no_grad()
def evaluate(model, wins: torch.Tensor, batch: int, num_experts: int, top_k: int):
    """Mean next-token loss (nats/token) over ``wins`` and per-layer expert assignment counts."""
    model.eval()
    layers = model.model.layers
    counts = torch.zeros(len(layers), num_experts, dtype=torch.long)
    handles = []
    for li, layer in enumerate(layers):

        def hook(_mod, _inp, out, li=li):
            top_idx = out[2]  # the router returns (logits, top-k weights, top-k expert ids)
            counts[li] += torch.bincount(top_idx.reshape(-1), minlength=num_experts)

        handles.append(layer.mlp.gate.register_forward_hook(hook))
    total_loss, total_tok = 0.0, 0
    try:
        for i in range(0, len(wins), batch):
            x = wins[i : i + batch]
            logits = model(input_ids=x).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
            )
            total_loss += loss.item()
            total_tok += x[:, 1:].numel()
    finally:
        for h in handles:
            h.remove()
    return total_loss / total_tok, counts


def routing_table(counts: torch.Tensor, top_k: int) -> list[dict]:
    """Per-layer routing statistics from [layers, experts] assignment counts."""
    out = []
    num_experts = counts.shape[1]
    for li, row in enumerate(counts):
        share = row.double() / row.sum()
        nz = share[share > 0]
        entropy = float(-(nz * nz.log2()).sum())
        lo, hi = float(share.min()), float(share.max())
        out.append(
            {
                "layer": li,
                "tokens": int(row.sum()) // top_k,
                "share": [round(float(s), 6) for s in share],
                "min_share": round(lo, 6),
                "max_share": round(hi, 6),
                "max_min_ratio": round(hi / lo, 3) if lo > 0 else None,
                "entropy_bits": round(entropy, 4),
                "max_entropy_bits": round(math.log2(num_experts), 4),
            }
        )
    return out


def unigram_loss(train_stream: torch.Tensor, eval_wins: torch.Tensor, vocab: int) -> float:
    """Cross-entropy (nats/token) of the eval targets under add-one-smoothed train unigram counts."""
    counts = torch.bincount(train_stream, minlength=vocab).double() + 1.0
    logp = (counts / counts.sum()).log()
    targets = eval_wins[:, 1:].reshape(-1)
    return float(-logp[targets].mean())


def print_routing(table: list[dict]) -> None:
    num_experts = len(table[0]["share"])
    head = "layer " + " ".join(f"  e{e:<3d}" for e in range(num_experts)) + "   max/min  entropy(bits)"
    log(head)
    for row in table:
        ratio = "inf" if row["max_min_ratio"] is None else f"{row['max_min_ratio']:.1f}"
        shares = " ".join(f"{s:6.3f}" for s in row["share"])
        log(f"{row['layer']:>5d} {shares} {ratio:>9s}  {row['entropy_bits']:.3f}/{row['max_entropy_bits']:.0f}")
    log(f"(uniform share = {1 / num_experts:.3f})")


@torch.no_grad()
def greedy_samples(model, hf_tok, max_new_tokens: int) -> dict[str, str]:
    model.eval()
    out = {}
    for prompt in GENERATION_PROMPTS:
        ids = hf_tok(prompt, return_tensors="pt").input_ids
        gen = model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD_ID, eos_token_id=EOS_ID
        )
        out[prompt] = hf_tok.decode(gen[0], skip_special_tokens=True)
    return out


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=sorted(ARCHS), default="mixtral")
    ap.add_argument("--out", type=Path, default=None, help="default: tests/fixtures/trained_<arch>")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=60, help="linear warmup steps")
    ap.add_argument("--min-lr-frac", type=float, default=0.1, help="final lr as a fraction of peak")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--router-lr-mult", type=float, default=1.0, help="router lr = this x lr")
    ap.add_argument("--router-init-std", type=float, default=None, help="router weight init std (default: config's)")
    ap.add_argument("--eval-windows", type=int, default=None, help="cap held-out windows (default: all)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    hparams, _, model_cls, experts_key, default_dir = ARCHS[args.arch]
    if args.out is None:
        args.out = REPO_ROOT / "tests" / "fixtures" / default_dir

    torch.set_num_threads(args.threads)
    t_start = time.time()
    import tokenizers
    import transformers

    log(f"torch {torch.__version__}, transformers {transformers.__version__}, tokenizers {tokenizers.__version__}, "
        f"python {platform.python_version()}, threads {torch.get_num_threads()}")

    # ---- data + tokenizer
    train_texts = split_texts("train")
    heldout_texts = split_texts("heldout")
    log(f"corpus: train {len(train_texts)} files / {sum(len(t) for t in train_texts) / 1e6:.2f} M chars, "
        f"heldout {len(heldout_texts)} files / {sum(len(t) for t in heldout_texts) / 1e6:.2f} M chars")
    t0 = time.time()
    tok = train_tokenizer(train_texts, hparams["vocab_size"])
    log(f"tokenizer: vocab {tok.get_vocab_size()} trained in {time.time() - t0:.1f}s")
    train_stream = token_stream(tok, train_texts)
    heldout_stream = token_stream(tok, heldout_texts)
    log(f"tokens: train {len(train_stream):,}, heldout {len(heldout_stream):,} "
        f"({sum(len(t) for t in train_texts) / len(train_stream):.2f} chars/token on train)")

    # ---- model
    model = build_model(args.seed, args.router_init_std, args.arch)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {model_cls}, {n_params:,} parameters, experts impl {model.config._experts_implementation}")
    opt = make_optimizer(model, args.lr, args.weight_decay, args.router_lr_mult)
    gen = torch.Generator().manual_seed(args.seed)
    max_start = len(train_stream) - args.seq_len
    tokens_per_step = args.batch * args.seq_len

    # ---- train
    model.train()
    t_train = time.time()
    cpu_train = time.process_time()
    recent: list[float] = []
    loss_curve = []
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, args.warmup, args.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr * g["lr_mult"]
        starts = torch.randint(0, max_start, (args.batch,), generator=gen)
        x = torch.stack([train_stream[s : s + args.seq_len] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent.append(loss.item())
        if (step + 1) % 25 == 0 or step == 0:
            avg = sum(recent[-25:]) / len(recent[-25:])
            loss_curve.append({"step": step + 1, "train_loss": round(avg, 4)})
            el = time.time() - t_train
            eta = el / (step + 1) * (args.steps - step - 1)
            log(f"step {step + 1:5d}/{args.steps}  loss {avg:.3f}  lr {lr:.2e}  "
                f"{tokens_per_step * (step + 1) / el:,.0f} tok/s  elapsed {el / 60:.1f} min  eta {eta / 60:.1f} min")
    train_seconds = time.time() - t_train
    train_cpu_seconds = time.process_time() - cpu_train
    final_train_loss = sum(recent[-50:]) / len(recent[-50:])
    log(f"training done in {train_seconds / 60:.1f} min wall, {train_cpu_seconds / 60:.1f} min CPU; "
        f"mean train loss over last 50 steps {final_train_loss:.3f}")

    # ---- save (bf16), then measure the saved artifact itself
    out: Path = args.out
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.to(torch.bfloat16).save_pretrained(str(tmp), safe_serialization=True)
    save_tokenizer(tok, tmp, hparams["max_position_embeddings"])
    del model

    import transformers
    from transformers import AutoTokenizer

    # bf16 weights upcast to fp32: the unquantized reference later stages compare against.
    saved = getattr(transformers, model_cls).from_pretrained(str(tmp), dtype=torch.float32)
    hf_tok = AutoTokenizer.from_pretrained(str(tmp))
    n_exp, top_k = hparams[experts_key], hparams["num_experts_per_tok"]
    t0 = time.time()
    held_wins = windows(heldout_stream, args.seq_len, args.eval_windows)
    held_loss, held_counts = evaluate(saved, held_wins, 16, n_exp, top_k)
    train_wins = windows(train_stream, args.seq_len, len(held_wins))
    train_eval_loss, _ = evaluate(saved, train_wins, 16, n_exp, top_k)
    uni = unigram_loss(train_stream, held_wins, hparams["vocab_size"])
    log(f"eval ({time.time() - t0:.0f}s, {held_wins.numel():,} held-out tokens):")
    log(f"  held-out loss {held_loss:.4f} nats/token (ppl {math.exp(held_loss):.2f})")
    log(f"  train    loss {train_eval_loss:.4f} nats/token (ppl {math.exp(train_eval_loss):.2f})")
    log(f"  unigram baseline on held-out {uni:.4f} (ppl {math.exp(uni):.2f}); "
        f"log(vocab) = {math.log(hparams['vocab_size']):.4f}")
    table = routing_table(held_counts, top_k)
    log("routing on held-out (share of top-k assignments per expert):")
    print_routing(table)
    samples = greedy_samples(saved, hf_tok, 60)
    for prompt, text in samples.items():
        log(f"--- greedy from {prompt!r}:\n{text}\n---")

    record = {
        "description": f"Small {model_cls[:-len('ForCausalLM')]}-architecture MoE trained on Python stdlib sources "
                       "(trtmoe.data train split)",
        "reproduce": "python scripts/make_trained_fixture.py" + ("" if args.arch == "mixtral" else f" --arch {args.arch}")
                     + f" --out tests/fixtures/{default_dir}"
                     + "".join(f" --{k.replace('_', '-')} {v}" for k, v in (("steps", args.steps), ("seq_len", args.seq_len),
                                                                         ("lr", args.lr), ("warmup", args.warmup))
                               if v != ap.get_default(k)),
        "seed": args.seed,
        "training": {
            "steps": args.steps,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "tokens_seen": args.steps * tokens_per_step,
            "optimizer": "AdamW(betas=(0.9, 0.95), eps=1e-8), grad clip 1.0",
            "peak_lr": args.lr,
            "warmup_steps": args.warmup,
            "schedule": f"linear warmup, cosine decay to {args.min_lr_frac} x peak",
            "weight_decay": args.weight_decay,
            "router_lr_mult": args.router_lr_mult,
            "router_init_std": args.router_init_std,
            "threads": torch.get_num_threads(),
            "wall_seconds": round(train_seconds, 1),
            "cpu_seconds": round(train_cpu_seconds, 1),
            "loss_curve": loss_curve,
        },
        "corpus": {
            "source": "python stdlib .py files via trtmoe.data.corpus_split",
            "python_version": platform.python_version(),
            "train_files": len(train_texts),
            "heldout_files": len(heldout_texts),
            "train_tokens": len(train_stream),
            "heldout_tokens": len(heldout_stream),
        },
        "metrics": {
            "units": "nats per token (natural log); eval in float32 from the saved bfloat16 weights",
            "train_loss_last50_steps": round(final_train_loss, 4),
            "train_eval_loss": round(train_eval_loss, 4),
            "heldout_loss": round(held_loss, 4),
            "heldout_perplexity": round(math.exp(held_loss), 3),
            "heldout_eval_tokens": held_wins.numel(),
            "unigram_heldout_loss": round(uni, 4),
            "log_vocab": round(math.log(hparams["vocab_size"]), 4),
        },
        "routing_heldout": table,
        "greedy_samples": samples,
        "tokenizer": dict(TOKENIZER_HPARAMS, vocab_size=hparams["vocab_size"]),
        "model": dict(hparams, parameters=n_params, saved_dtype="bfloat16"),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "python": platform.python_version(),
        },
    }
    (tmp / "fixture.json").write_text(json.dumps(record, indent=2) + "\n")
    readme = out / "README.md"
    if readme.exists():  # the README is hand-written; keep it across regenerations
        shutil.copy2(readme, tmp / "README.md")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    size = dir_bytes(out)
    log(f"wrote {out} ({size / 1e6:.2f} MB); total {(time.time() - t_start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
