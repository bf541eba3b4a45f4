"""Triton Python model `tensorrt_llm` of a `trtmoe repo --layout llmapi` repository: text in, text out.

Its inputs and outputs are those of the `llmapi` model of TensorRT-LLM 1.2's Triton backend (driven by
that project's `triton_backend/tools/llmapi_client.py`); here trtmoe's embedded engine answers them,
behind the same in-flight batcher as the default layout's `tensorrt_llm` model. The tokenizer runs in
this process, so a streamed token crosses no ensemble and no pre/postprocessing model on its way out.

The rules it keeps:
* One prompt per request: the first string of the 1-D `text_input` (`max_batch_size: 0`).
* `streaming` true needs the decoupled model (`trtmoe repo --layout llmapi --streaming`); a decoupled
  model answers a non-streaming request with one final response too.
* `text_output` is the generated text only, never the prompt. A streamed response carries all the text
  generated so far (the LLM API's `CompletionOutput.text`); it never ends inside a character.
* `sampling_param_max_tokens` defaults to 32; `sampling_param_min_tokens` (an input of trtmoe's: the
  LLM API's SamplingParams.min_tokens) holds the end id back that long. Greedy unless
  `sampling_param_temperature` > 0, `sampling_param_top_k` > 1 or `sampling_param_top_p` < 1 asks for
  sampling (temperature 1 then, unless given); `sampling_param_seed` makes it repeatable. Frequency and
  presence penalties as given.
* `sampling_param_stop` strings end the generation (matched on their token ids) and are left out of
  the text.
* `stop` true with the request id of a running generation ends it (it answers with what it has,
  finish reason `cancelled`); the stop request itself gets a CANCELLED error, as upstream answers it.
  A request its client cancels ends with a CANCELLED error.
* `return_finish_reason`: `stop` (the end id or a stop string), `length` or `cancelled`;
  `return_stop_reason`: the stop string that ended it, else `None`; `return_cumulative_logprob`: the
  sum of the generated tokens' log-probabilities. `sampling_param_return_perf_metrics` adds the
  request's times (wall clock, ns) and its KV-cache block counts (the embedded engine reuses no
  blocks across requests). `return_num_output_tokens` (trtmoe's addition, named as TensorRT-LLM 1.2's
  `tensorrt_llm` input) puts the count of tokens generated so far on every response.
* The routing gauges (`trtmoe_*`) and TensorRT-LLM's `nv_trt_llm_*` gauges are exported on the
  server's metrics port, as by the default layout's `tensorrt_llm` model.
* What the embedded engine does not do is refused with INVALID_ARG rather than ignored:
  `sampling_param_best_of` > 1, `image_url`, LoRA adapters.
"""

from __future__ import annotations

import gc
import json
import os
import threading
from collections import deque

import numpy as np
import triton_python_backend_utils as pb_utils

from trtmoe.triton.batcher import FINISH_CANCELLED, FINISH_ERROR, InflightBatcher
from trtmoe.triton.inflight.requests import wall_clock_offset_ns
from trtmoe.triton.metrics import blocks as kv_blocks
from trtmoe.triton.model_params import model_flag, model_param
from trtmoe.triton.textstream import IncrementalText, windows_decode_exactly
from trtmoe.triton.threads import name_native_thread

DEFAULT_MAX_TOKENS = 32  # the LLM API's SamplingParams default
_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class BadRequest(ValueError):
    """Answered with INVALID_ARG and the message."""


def _scalar(arrays: dict, name: str):
    t = arrays.get(name)
    if t is None:
        return None
    a = t.as_numpy()
    if a.size != 1:
        raise BadRequest(f"{name} must hold one value, got shape {list(a.shape)}")
    return a.reshape(-1)[0].item()


def max_token_bytes(tokenizer) -> int:
    """The UTF-8 length of the longest vocabulary entry (added tokens included): no token covers more
    bytes of text than that, so a text of more than ``n`` times as many bytes is over ``n`` tokens."""
    return max((len(t.encode("utf-8")) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1) or 1


def _strings(arrays: dict, name: str) -> list[str]:
    t = arrays.get(name)
    if t is None:
        return []
    return [x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in t.as_numpy().reshape(-1)]


class _Generation:
    """One request being answered."""

    def __init__(self, sender, request_id: str, prompt: list[int], streaming: bool, stops: list[str],
                 outputs: dict, text: IncrementalText):
        self.sender, self.request_id, self.prompt, self.streaming = sender, request_id, prompt, streaming
        self.stops, self.outputs = stops, outputs
        self.text = text  # the generated text so far, decoded a window per response
        self.sent_chars = 0  # length of the text the latest streamed response carried
        self.stop_hit: tuple[str, int] | None = None  # (stop string, where the text ends) once one appeared
        self.answered = False  # its final response is queued


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        # torch (and what imports it) only here, as in the default layout's model.
        from tokenizers import Tokenizer

        from trtmoe.runtime.engine import SamplingParams
        from trtmoe.triton.served import ServedMetrics, load_served_engine

        self.SamplingParams = SamplingParams
        try:
            served = load_served_engine(config, args["model_repository"])
        except ValueError as e:
            raise pb_utils.TritonModelException(str(e)) from None
        self.engine, self.info, self.limits = served.engine, served.info, served.limits
        tok_dir = served.resolve(model_param(config, "tokenizer_dir"))
        self.tokenizer = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
        self.add_special_tokens = model_flag(config, "add_special_tokens", True)
        # A prompt of more bytes than this is over max_input_len tokens: refused before tokenizing.
        self.max_prompt_bytes = self.limits.max_input_len * max_token_bytes(self.tokenizer)
        skip = model_flag(config, "skip_special_tokens", True)
        self.decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=skip)
        self.windowed_text = windows_decode_exactly(self.tokenizer)
        self.stopped: set[str] = set()  # request ids a `stop` request ended (they answer with their text)
        self.outbox: deque = deque()  # (sender, response or None, flags), sent in order by the sender thread
        self.wake = threading.Event()
        self.closing = False
        self.sender_thread = threading.Thread(target=self._send_loop, name="tensorrt_llm-sender", daemon=True)
        self.sender_thread.start()
        # Routing and nv_trt_llm_* gauges on the metrics port, as the default layout's model exports them.
        self.metrics = ServedMetrics(pb_utils, self.engine, config, args.get("model_name", "tensorrt_llm"),
                                     str(args.get("model_version", "1")), int(self.info.tokens_per_block))
        size = int(model_param(config, "engine_max_batch_size", str(self.info.max_batch_size)))
        self.batcher = InflightBatcher(self.metrics.recorder,
                                       max_batch_size=max(1, min(size, self.info.max_batch_size)),
                                       max_waiting=int(model_param(config, "max_waiting_requests", "0") or 0),
                                       stream_interval=max(int(model_param(config, "stream_interval", "0")), 0),
                                       on_flush=self._flush, cpu_cores=served.decode_cores)
        self.metrics.start(self.batcher)
        pb_utils.Logger.log_info(f"tensorrt_llm (llmapi): embedded engine {self.info.architecture}, "
                                 f"max_batch_size={self.batcher.max_batch_size} decoupled={self.decoupled}")
        served.log_binding(pb_utils.Logger)
        gc.collect()
        gc.freeze()

    # -- requests ------------------------------------------------------------------------------
    def _params(self, arrays: dict):
        best_of = _scalar(arrays, "sampling_param_best_of")
        if best_of is not None and int(best_of) != 1:
            raise BadRequest(f"sampling_param_best_of {best_of}: the embedded engine returns one sequence per request")
        if _strings(arrays, "image_url"):
            raise BadRequest("image_url: the embedded engine serves text models only")
        if any(arrays.get(n) is not None for n in ("lora_id", "lora_name", "lora_path", "lora_ckpt_source")):
            raise BadRequest("lora_*: the embedded engine serves no LoRA adapters")
        max_tokens = _scalar(arrays, "sampling_param_max_tokens")
        max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else int(max_tokens)
        if max_tokens < 1:
            raise BadRequest(f"sampling_param_max_tokens must be at least 1, got {max_tokens}")
        temperature = _scalar(arrays, "sampling_param_temperature")
        top_k = _scalar(arrays, "sampling_param_top_k")
        top_p = _scalar(arrays, "sampling_param_top_p")
        sampled = (temperature is not None and temperature > 0) or (top_k is not None and top_k > 1) or (
            top_p is not None and top_p < 1)
        if temperature is not None and temperature < 0:
            raise BadRequest(f"sampling_param_temperature must be at least 0, got {temperature}")
        if top_k is not None and top_k < 0:
            raise BadRequest(f"sampling_param_top_k must be at least 0, got {top_k}")
        if top_p is not None and not 0 < top_p <= 1:
            raise BadRequest(f"sampling_param_top_p must be in (0, 1], got {top_p}")
        min_tokens = int(_scalar(arrays, "sampling_param_min_tokens") or 0)
        if not 0 <= min_tokens <= max_tokens:
            raise BadRequest(f"sampling_param_min_tokens must be between 0 and sampling_param_max_tokens "
                             f"({max_tokens}), got {min_tokens}")
        seed = _scalar(arrays, "sampling_param_seed")
        params = self.SamplingParams(
            max_new_tokens=max_tokens,
            temperature=(float(temperature) if temperature else 1.0) if sampled else 0.0,
            top_k=int(top_k or 0), top_p=float(top_p if top_p is not None else 1.0),
            seed=None if seed is None else int(seed), end_id=self.limits.default_end_id, min_tokens=min_tokens,
            frequency_penalty=float(_scalar(arrays, "sampling_param_frequency_penalty") or 0.0),
            presence_penalty=float(_scalar(arrays, "sampling_param_presence_penalty") or 0.0),
            return_log_probs=bool(_scalar(arrays, "return_cumulative_logprob")))
        return params

    def _submit(self, request, sender) -> None:
        arrays = {t.name(): t for t in request.inputs()}
        if _scalar(arrays, "stop"):
            rid = request.request_id()
            if not rid:
                raise BadRequest("a stop request needs the request id of the generation to stop")
            self.stopped.add(rid)  # before the cancel: the decode thread may end it at once
            if not self.batcher.cancel(rid):
                self.stopped.discard(rid)
            self.outbox.append((sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(
                "Request cancelled by client", pb_utils.TritonError.CANCELLED)), _FINAL))
            self._flush()
            return
        texts = _strings(arrays, "text_input")
        if not texts:
            raise BadRequest("text_input is missing or empty")
        streaming = bool(_scalar(arrays, "streaming"))
        if streaming and not self.decoupled:
            raise BadRequest("streaming needs a decoupled model: write the repository with "
                             "`trtmoe repo --layout llmapi --streaming`")
        params = self._params(arrays)
        size = len(texts[0].encode("utf-8"))
        if size > self.max_prompt_bytes:
            raise BadRequest(f"text_input is {size} bytes, more than {self.limits.max_input_len} tokens (this "
                             "engine's max_input_len) can hold: refused before tokenizing")
        prompt = self.tokenizer.encode(texts[0], add_special_tokens=self.add_special_tokens).ids
        if not prompt:
            raise BadRequest("text_input encodes to no tokens")
        if len(prompt) > self.limits.max_input_len:
            raise BadRequest(f"the prompt has {len(prompt)} tokens; this engine takes at most "
                             f"{self.limits.max_input_len}")
        if len(prompt) + params.max_new_tokens > self.limits.max_seq_len:
            raise BadRequest(f"prompt ({len(prompt)} tokens) + sampling_param_max_tokens ({params.max_new_tokens}) "
                             f"exceeds the engine's max_seq_len {self.limits.max_seq_len}")
        try:
            self.engine.check_request(prompt, params)
        except Exception as e:  # noqa: BLE001 - the engine's own one-line reason
            raise BadRequest(str(e)) from None
        stops = [s for s in _strings(arrays, "sampling_param_stop") if s]
        outputs = {name: bool(_scalar(arrays, name)) for name in
                   ("return_finish_reason", "return_stop_reason", "return_cumulative_logprob",
                    "sampling_param_return_perf_metrics", "return_num_output_tokens")}
        gen = _Generation(sender, request.request_id(), prompt, streaming, stops, outputs,
                          IncrementalText(self.decode, self.windowed_text))
        self.batcher.submit(prompt, params, lambda ev: self._on_event(gen, ev), request_id=request.request_id(),
                            is_cancelled=getattr(sender, "is_cancelled", None))

    def execute(self, requests):
        # Every request is answered through its response sender (decoupled or not), so execute
        # returns at once and the next requests join the running batch.
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except BadRequest as e:
                sender.send(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)), flags=_FINAL)
            except Exception as e:  # noqa: BLE001
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"tensorrt_llm: {e}")),
                            flags=_FINAL)
        return None

    # -- responses (decode thread builds, sender thread sends) ---------------------------------
    def _text(self, gen: _Generation, tokens: list[int], final: bool) -> str:
        """The text so far: cut before a stop string (the first to appear, as the LLM API cuts it),
        and never ending inside a character while more may come."""
        text = gen.text.update(tokens, final or gen.stop_hit is not None)
        if gen.stops and gen.stop_hit is None:
            hits = [(i, s) for s in gen.stops for i in [text.find(s)] if i >= 0]
            if hits:
                at, stop = min(hits)
                gen.stop_hit = (stop, at)
        return text if gen.stop_hit is None else text[:gen.stop_hit[1]]

    def _on_event(self, gen: _Generation, event) -> None:
        """Batcher callback (decode thread): builds the response, if any, for the sender thread. A
        response that cannot be built ends its request with the error (never without a final one)."""
        if gen.answered:
            return
        try:
            self._respond(gen, event)
        except Exception as e:  # noqa: BLE001
            gen.answered = True
            event.request.cancel()
            self.outbox.append((gen.sender, pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"tensorrt_llm: {e}")), _FINAL))

    def _respond(self, gen: _Generation, event) -> None:
        if not (gen.streaming or event.finished or gen.stops):
            return
        req = event.request
        if event.finished and event.finish_reason == FINISH_ERROR:
            self.outbox.append((gen.sender, pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"generation failed: {event.error}")), _FINAL))
            return
        if event.finished and event.finish_reason == FINISH_CANCELLED and gen.stop_hit is None:
            if gen.request_id in self.stopped:  # ended by a `stop` request: it answers with its text
                self.stopped.discard(gen.request_id)
            else:  # its client cancelled it
                self.outbox.append((gen.sender, pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    "Request cancelled by client", pb_utils.TritonError.CANCELLED)), _FINAL))
                return
        text = self._text(gen, req.tokens, event.finished)
        if gen.stop_hit is not None and not event.finished:
            req.cancel()  # a stop string appeared: end here (the final event comes before the next step)
            return
        reason = "stop" if gen.stop_hit is not None else event.finish_reason
        stop = gen.stop_hit[0] if gen.stop_hit is not None else None
        if not event.finished:
            # Unstreamed, an event served only the stop check above; streamed, a response that would show
            # nothing new (a character still incomplete) waits for the next.
            if not gen.streaming or len(text) == gen.sent_chars:
                return
            gen.sent_chars = len(text)
        out = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=object))]
        if gen.outputs["return_num_output_tokens"]:
            out.append(pb_utils.Tensor("num_output_tokens", np.array([len(req.tokens)], dtype=np.int32)))
        if event.finished:
            o = gen.outputs
            if o["return_finish_reason"]:
                out.append(pb_utils.Tensor("finish_reason", np.array([reason.encode()], dtype=object)))
            if o["return_stop_reason"]:
                out.append(pb_utils.Tensor("stop_reason", np.array([str(stop).encode("utf-8")], dtype=object)))
            if o["return_cumulative_logprob"]:
                lps = getattr(req.seq, "log_probs", None) or []
                out.append(pb_utils.Tensor("cumulative_logprob", np.array([sum(lps[:len(req.tokens)])],
                                                                            dtype=np.float32)))
            if o["sampling_param_return_perf_metrics"]:
                out += self._perf(gen, req)
        gen.answered = event.finished
        self.outbox.append((gen.sender, pb_utils.InferenceResponse(output_tensors=out),
                            _FINAL if event.finished else 0))

    def _perf(self, gen: _Generation, req) -> list:
        off = wall_clock_offset_ns()
        # The KV-cache row reserved for the sequence at admission, in blocks (the pool shares no prefixes).
        reserved = getattr(req.seq, "kv_capacity", 0) or len(gen.prompt) + len(req.tokens)
        blocks = kv_blocks(reserved, int(self.info.tokens_per_block))

        def one(name, value, dtype):
            return pb_utils.Tensor(name, np.array([value], dtype=dtype))

        return [one("arrival_time_ns", req.arrival_ns + off, np.int64),
                one("first_scheduled_time_ns", (req.first_scheduled_ns or req.arrival_ns) + off, np.int64),
                one("first_token_time_ns", (req.first_token_ns or req.arrival_ns) + off, np.int64),
                one("last_token_time_ns", (req.last_token_ns or req.arrival_ns) + off, np.int64),
                one("kv_cache_reused_block", 0, np.int32), one("kv_cache_missed_block", blocks, np.int32),
                one("kv_cache_alloc_new_blocks", blocks, np.int32),
                one("kv_cache_alloc_total_blocks", blocks, np.int32),
                one("kv_cache_hit_rate", 0.0, np.float32)]

    def _flush(self):
        if self.outbox and not self.wake.is_set():
            self.wake.set()

    def _send_loop(self):
        name_native_thread("trtmoe-send")
        while True:
            self.wake.wait()
            self.wake.clear()
            while self.outbox:
                sender, resp, flags = self.outbox.popleft()
                try:
                    sender.send(resp, flags=flags)
                except Exception as e:  # noqa: BLE001 - the client is gone
                    pb_utils.Logger.log_warn(f"tensorrt_llm: a response could not be sent: {e}")
            if self.closing and not self.outbox:
                return

    def finalize(self):
        self.metrics.stop()
        self.batcher.shutdown()
        self.closing = True
        self.wake.set()
        self.sender_thread.join(timeout=10)
