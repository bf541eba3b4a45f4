"""Turn the ``tensorrt_llm`` model's input tensors into generation requests for the embedded engine,
and reject what the engine cannot do with a message naming the input and the limit.

Pure numpy: the Triton glue (``model_repo/tensorrt_llm/1/model.py``) hands in a ``get(name)``
function returning each input as an array (batch first) or ``None`` when absent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np


class RequestError(ValueError):
    """A request the engine cannot serve; the message is sent back to the client as is."""


@dataclass(frozen=True)
class EngineLimits:
    """Token limits a request is checked against (from the engine's build_config)."""

    max_input_len: int
    max_seq_len: int
    vocab_size: int
    max_beam_width: int = 1
    default_end_id: int | None = None
    gather_context_logits: bool = False  # build_config flags: the engine may return these logits
    gather_generation_logits: bool = False


@dataclass
class GenerationRequest:
    """One prompt of a (possibly batched) Triton request."""

    batch_index: int
    prompt_ids: list[int]
    max_new_tokens: int
    params: Any
    streaming: bool
    exclude_input_in_output: bool
    stop_sequences: list[list[int]] = field(default_factory=list)
    return_perf_metrics: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    batch_size: int = 1  # prompts in the Triton request this one came from
    sequence_index: int = 0  # which of its prompt's num_return_sequences this is
    num_sequences: int = 1  # num_return_sequences of its prompt (sampled sequences; with beams: beams returned)
    beam_width: int = 1
    sent_tokens: int = 0  # generated tokens already sent back (owned by the responder)
    held: list[int] = field(default_factory=list)  # streamed ids held back until a character is whole
    beam_results: list = field(default_factory=list)  # a beam search's ranked beams at its latest event


Getter = Callable[[str], "np.ndarray | None"]

# Inputs that change results and that the embedded engine does not implement: name -> the value
# that means "not used". A request setting anything else gets a RequestError instead of a silent
# difference from the TensorRT engine.
_NEUTRAL = {
    "runtime_top_p_min": None,
    "runtime_top_p_decay": None, "runtime_top_p_reset_ids": None,
    "draft_acceptance_threshold": None,
    "prompt_vocab_size": None, "lora_task_id": None, "mrope_position_deltas": None,
}
# Inputs the embedded engine never accepts (any value is an error).
_UNSUPPORTED = ("encoder_input_features", "encoder_output_lengths", "draft_input_ids", "draft_logits",
                "prompt_embedding_table", "prompt_table_extra_ids", "cross_attention_mask",
                "mrope_rotary_cos_sin", "lora_weights", "lora_config", "context_phase_params",
                "skip_cross_attn_blocks", "guided_decoding_guide_type", "guided_decoding_guide",
                "lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size")


def _scalar(get: Getter, name: str, b: int) -> Any:
    """The b-th value of a per-prompt scalar input ([B], [B, 1] or a single value), or None."""
    arr = get(name)
    if arr is None:
        return None
    a = np.asarray(arr)
    a = a.reshape(1, 1) if a.ndim == 0 else a.reshape(a.shape[0], -1)
    row = a[b if a.shape[0] > 1 else 0]
    return row[0].item() if row.size else None


def word_list(arr: np.ndarray | None, b: int) -> list[list[int]]:
    """Decode TensorRT-LLM's ``[2, L]`` word-list format (flat ids; end offsets padded with -1)."""
    if arr is None:
        return []
    a = np.asarray(arr)
    if a.ndim == 2:
        a = a[None]
    if a.ndim != 3 or a.shape[1] != 2:
        raise RequestError(f"stop/bad word list must have shape [batch, 2, L], got {list(np.asarray(arr).shape)}")
    row = a[b if a.shape[0] > 1 else 0]
    ids, offsets = row[0].tolist(), row[1].tolist()
    words, start = [], 0
    for end in offsets:
        if end < 0:
            break
        if end > len(ids) or end < start:
            raise RequestError("malformed stop/bad word list offsets")
        if end > start:
            words.append([int(t) for t in ids[start:end]])
        start = end
    return words


# TensorRT-LLM 1.2 input name -> the name tensorrtllm_backend <= v0.19.0 used for it; either is accepted.
ALIASES = {"min_tokens": "min_length", "seed": "random_seed"}


def _aliased(get: Getter, name: str, b: int) -> Any:
    """``name``'s value, or its older alias's; both given with different values is an error."""
    new, old = _scalar(get, name, b), _scalar(get, ALIASES[name], b)
    if new is not None and old is not None and new != old:
        raise RequestError(f"input '{name}'={new} and its older name '{ALIASES[name]}'={old} disagree; send one")
    return new if new is not None else old


def parse_requests(get: Getter, limits: EngineLimits, make_params: Callable[..., Any], *,
                   default_exclude_input: bool = False, decoupled: bool = True) -> list[GenerationRequest]:
    """Validate one Triton request (batch of B prompts) and build a GenerationRequest per prompt."""
    for name in _UNSUPPORTED:
        arr = get(name)
        if arr is not None and np.asarray(arr).size:
            raise RequestError(f"input '{name}' is not supported by the embedded engine")
    input_ids = get("input_ids")
    if input_ids is None:
        raise RequestError("missing input 'input_ids'")
    input_ids = np.asarray(input_ids)
    if input_ids.ndim == 1:
        input_ids = input_ids[None]
    batch = input_ids.shape[0]
    if get("request_output_len") is None:
        raise RequestError("missing input 'request_output_len' (the ensemble's 'max_tokens')")
    if batch > 1 and not decoupled:
        raise RequestError("a request with batch size > 1 needs the decoupled tensorrt_llm model")
    reqs = []
    for b in range(batch):
        prompt = _prompt(get, input_ids, b, limits)
        max_new = _max_new_tokens(get, b, len(prompt), limits)
        n_seq, beam = _refuse_unsupported(get, b, limits)
        if n_seq > 1 and not decoupled and beam == 1:
            raise RequestError(f"num_return_sequences {n_seq} sends one response per sequence: it needs the "
                               "decoupled tensorrt_llm model (regenerate the repository with streaming enabled)")
        kwargs = _sampling_kwargs(get, b, max_new, limits)
        generations = n_seq
        stops = word_list(get("stop_words_list"), b)
        if beam > 1:
            # Each beam meets its stop words itself (the search then keeps or drops it); the batcher
            # does not stop the request on the best beam's tokens.
            kwargs = {**_beam_kwargs(get, b, kwargs, beam, n_seq), "stop_words": stops}
            stops = []
            generations = 1  # the beams come back together, in one result (sequence_index 0)
        excl = _scalar(get, "exclude_input_in_output", b)
        streaming = bool(_scalar(get, "streaming", b) or False)
        if streaming and not decoupled:
            raise RequestError("streaming is only supported when tensorrt_llm is decoupled "
                               "(regenerate the repository with streaming enabled)")
        for i, seed in enumerate(_sequence_seeds(kwargs["seed"], generations)):
            reqs.append(GenerationRequest(
                batch_index=b, prompt_ids=prompt, max_new_tokens=max_new, params=make_params(**{**kwargs, "seed": seed}),
                streaming=streaming, exclude_input_in_output=bool(default_exclude_input if excl is None else excl),
                stop_sequences=stops,
                return_perf_metrics=bool(_scalar(get, "return_perf_metrics", b) or False),
                return_num_input_tokens=bool(_scalar(get, "return_num_input_tokens", b) or False),
                return_num_output_tokens=bool(_scalar(get, "return_num_output_tokens", b) or False),
                batch_size=batch, sequence_index=i, num_sequences=n_seq, beam_width=beam))
    return reqs


def _beam_kwargs(get: Getter, b: int, kwargs: dict[str, Any], beam: int, n_return: int | None) -> dict[str, Any]:
    """Sampling keyword arguments for a beam search of width ``beam`` (TensorRT-LLM: top_k, top_p
    and the seed are not used; the temperature scales the log-probs, 0 meaning 1)."""
    temperature = _scalar(get, "temperature", b)
    t = float(temperature) if temperature is not None and float(temperature) > 0 else 1.0
    lp, es, div = (_scalar(get, n, b) for n in ("len_penalty", "early_stopping", "beam_search_diversity_rate"))
    return {**kwargs, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None, "greedy_temperature": t,
            "beam_width": beam, "len_penalty": float(lp) if lp is not None else 0.0,
            "early_stopping": int(es) if es is not None else 1,
            "diversity_rate": float(div) if div is not None else 0.0,
            "num_return_beams": n_return if _scalar(get, "num_return_sequences", b) is not None else None}


def _sequence_seeds(seed: int | None, n: int) -> list[int | None]:
    """The seed of each of a prompt's ``n`` sequences, as TensorRT-LLM's child requests get them:
    sequence i draws with seed + i (unsigned 64-bit), and without a seed the first one's is 0."""
    if n == 1:
        return [seed]
    base = 0 if seed is None else seed
    return [(base + i) % 2**64 for i in range(n)]


def _prompt(get: Getter, input_ids: np.ndarray, b: int, limits: EngineLimits) -> list[int]:
    """Prompt ``b``'s token ids, checked against its declared length, the engine's limit and vocabulary."""
    n = int(_scalar(get, "input_lengths", b)) if get("input_lengths") is not None else int(input_ids.shape[1])
    if n < 1:
        raise RequestError("empty prompt: input_lengths must be >= 1")
    if n > input_ids.shape[1]:
        raise RequestError(f"input_lengths {n} is longer than input_ids ({input_ids.shape[1]})")
    prompt = [int(t) for t in input_ids[b, :n].tolist()]
    if n > limits.max_input_len:
        raise RequestError(f"prompt has {n} tokens; this engine accepts at most {limits.max_input_len} "
                           "(build_config.max_input_len)")
    bad_ids = [t for t in prompt if t < 0 or t >= limits.vocab_size]
    if bad_ids:
        raise RequestError(f"token id {bad_ids[0]} is outside the vocabulary [0, {limits.vocab_size})")
    return prompt


def _max_new_tokens(get: Getter, b: int, n: int, limits: EngineLimits) -> int:
    max_new = int(_scalar(get, "request_output_len", b))
    if max_new < 1:
        raise RequestError(f"max_tokens (request_output_len) must be >= 1, got {max_new}")
    if n + max_new > limits.max_seq_len:
        raise RequestError(f"prompt ({n} tokens) + max_tokens ({max_new}) = {n + max_new} exceeds this engine's "
                           f"max_seq_len {limits.max_seq_len} (build_config.max_seq_len); ask for at most "
                           f"{max(limits.max_seq_len - n, 0)} tokens")
    return max_new


def _refuse_unsupported(get: Getter, b: int, limits: EngineLimits) -> tuple[int, int]:
    """Inputs the embedded engine cannot honour are refused by name unless they carry their neutral
    value. Returns the prompt's num_return_sequences and beam width."""
    beam = _scalar(get, "beam_width", b)
    beam = 1 if beam is None else int(beam)
    if beam < 1:
        raise RequestError(f"beam_width must be >= 1, got {beam}")
    if beam > limits.max_beam_width:  # TensorRT-LLM's wording
        raise RequestError(f"Requested beam width {beam} is larger than configured max beam width "
                           f"{limits.max_beam_width} (build the engine with --max-beam-width {beam})")
    nrs = _scalar(get, "num_return_sequences", b)
    n_seq = 1 if nrs is None else int(nrs)
    if n_seq < 1:
        raise RequestError(f"num_return_sequences must be >= 1, got {n_seq}")
    if beam > 1 and n_seq > beam:
        raise RequestError(f"num_return_sequences {n_seq} exceeds beam_width {beam}: beam search returns at most "
                           "its beams")
    if beam > 1 and bool(_scalar(get, "return_generation_logits", b) or False) and bool(_scalar(get, "streaming", b)):
        # TensorRT-LLM drops them there too: streamed beams re-rank, so earlier steps' rows would not hold.
        raise RequestError("input 'return_generation_logits' is not available for streamed beam search "
                           "(beam_width > 1 with streaming)")
    for name in ("len_penalty", "early_stopping", "beam_search_diversity_rate"):
        v = _scalar(get, name, b)
        if v is not None and not float(v) >= 0:
            raise RequestError(f"input '{name}' must be >= 0, got {v}")
    # TensorRT-LLM checks these when the request is fetched: a flag the engine was not built with
    # is an error, not an empty output.
    for name, flag in (("return_context_logits", "gather_context_logits"),
                       ("return_generation_logits", "gather_generation_logits")):
        if bool(_scalar(get, name, b) or False) and not getattr(limits, flag):
            raise RequestError(f"input '{name}' needs an engine built with {flag} (this one was not): rebuild it "
                               f"with `trtmoe build --{flag.replace('_', '-')}` (trtllm-build --{flag})")
    for name, neutral in _NEUTRAL.items():
        v = _scalar(get, name, b)
        if v is not None and v != neutral and not (neutral is None and v in (0, False)):
            raise RequestError(f"input '{name}'={v} is not supported by the embedded engine")
    dec_len = _scalar(get, "decoder_input_lengths", b)
    if get("decoder_input_ids") is not None and dec_len is not None and int(dec_len) > 1:
        raise RequestError("decoder_input_ids are for encoder-decoder engines; this engine is decoder-only")
    return n_seq, beam


def _sampling_kwargs(get: Getter, b: int, max_new: int, limits: EngineLimits) -> dict[str, Any]:
    """The keyword arguments of prompt ``b``'s sampling parameters (``make_params``' arguments)."""
    temperature = _scalar(get, "temperature", b)
    top_k = _scalar(get, "runtime_top_k", b)
    top_p = _scalar(get, "runtime_top_p", b)
    seed = _aliased(get, "seed", b)
    min_tokens = _aliased(get, "min_tokens", b)
    end_id = _scalar(get, "end_id", b)
    if temperature is not None and not 0 <= float(temperature) < float("inf"):  # NaN fails every comparison
        raise RequestError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_p is not None and not 0.0 <= float(top_p) <= 1.0:
        raise RequestError(f"top_p must be in [0, 1], got {top_p}")
    if top_k is not None and int(top_k) < 0:
        raise RequestError(f"top_k must be >= 0, got {top_k}")
    if min_tokens is not None and int(min_tokens) > max_new:
        raise RequestError(f"min_tokens {int(min_tokens)} > max_tokens {max_new}")
    if end_id is None:
        end_id = limits.default_end_id
    penalties = {}
    for name, neutral in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
        v = _scalar(get, name, b)
        if v is None or float(v) == neutral:
            continue
        if not np.isfinite(float(v)):
            raise RequestError(f"input '{name}' must be finite, got {v}")
        penalties[name] = float(v)
    if penalties.get("repetition_penalty", 1.0) <= 0:
        raise RequestError(f"input 'repetition_penalty' must be > 0, got {penalties['repetition_penalty']}")
    bad_words = word_list(get("bad_words_list"), b)
    for w in bad_words:
        if any(not 0 <= t < limits.vocab_size for t in w):
            raise RequestError(f"input 'bad_words_list' has token id outside the vocabulary [0, {limits.vocab_size}): {w}")
    bias = _bias_row(get, b, limits)
    # TensorRT-LLM decodes greedily unless top_k > 1 or top_p > 0; mirror that so both engines
    # answer a request the same way (a bare temperature stays greedy, as there).
    sampling = (top_k is not None and int(top_k) > 1) or (top_p is not None and float(top_p) > 0.0)
    extra: dict[str, Any] = dict(penalties)
    if bad_words:
        extra["bad_words"] = bad_words
    if bias is not None:
        extra["embedding_bias"] = bias
    if bool(_scalar(get, "return_log_probs", b) or False):
        extra["return_log_probs"] = True
    if extra and not sampling and temperature is not None:
        # A greedy request's temperature still scales its logits before the additive penalties.
        extra["greedy_temperature"] = float(temperature)
    for name in ("return_context_logits", "return_generation_logits"):  # raw logits: no processing
        if bool(_scalar(get, name, b) or False):
            extra[name] = True
    return dict(
        max_new_tokens=max_new,
        temperature=float(temperature if temperature is not None else 1.0) if sampling else 0.0,
        top_k=int(top_k or 0), top_p=float(top_p) if top_p else 1.0,  # TRT-LLM: top_p 0 = off
        seed=int(seed) if seed is not None else None,
        end_id=int(end_id) if end_id is not None and int(end_id) >= 0 else None,
        min_tokens=int(min_tokens or 0), **extra)


def _bias_row(get: Getter, b: int, limits: EngineLimits) -> "np.ndarray | None":
    """Prompt ``b``'s embedding_bias ([vocab] float32), or None when absent, empty or all zero."""
    arr = get("embedding_bias")
    if arr is None:
        return None
    a = np.asarray(arr, dtype=np.float32)
    if a.size == 0:
        return None
    a = a.reshape(1, -1) if a.ndim <= 1 else a.reshape(a.shape[0], -1)
    row = a[b if a.shape[0] > 1 else 0]
    if not np.any(row != 0):
        return None
    if row.size != limits.vocab_size:
        raise RequestError(f"input 'embedding_bias' has {row.size} values; it needs one per vocabulary id "
                           f"({limits.vocab_size})")
    if not np.all(np.isfinite(row)):
        raise RequestError("input 'embedding_bias' must be finite")
    return row.copy()
