"""Triton Python model `tensorrt_llm` for trtmoe's embedded engine.

Same inputs and outputs as the TensorRT-LLM C++ backend's model. One in-flight batcher thread owns
the engine: `execute` validates each request, hands its prompts to the batcher and returns at once,
decoupled or not (a non-decoupled model answers through the response sender too, with exactly one
response, so requests still join the running batch). The batcher thread builds each response as
its tokens arrive and a sender thread sends it through the request's response sender, the FINAL
flag on the last one (responses with logits are built by the sender, and there the tokens of one
request that piled up while the client was slow go out together). Routing and batcher metrics, and
TensorRT-LLM's `nv_trt_llm_*` gauges, are exported on the server's metrics port.

Cancellation: besides `stop` requests (TensorRT-LLM's contract), the model takes the keys of
cancelled generations from postprocessing and tensorrt_llm_bls over a socket of its own
(trtmoe.triton.cancel_channel), so a cancel never waits in, or is refused by, this model's request
queue; the batcher keeps such keys for a while, for a request that arrives after its cancel.

`engine_dir` and `tokenizer_dir` may be relative to the repository root, so a repository moved
together with its engine still serves.
"""

from __future__ import annotations

import gc
import json
import os
import threading
from collections import deque

import numpy as np
import triton_python_backend_utils as pb_utils

from trtmoe.triton.batcher import FINISH_ERROR, InflightBatcher
from trtmoe.triton.inflight.requests import wall_clock_offset_ns
from trtmoe.triton.llm_request import RequestError, parse_requests
from trtmoe.triton.metrics import blocks
from trtmoe.triton.model_params import model_flag as _flag
from trtmoe.triton.model_params import model_param as _param
from trtmoe.triton.textstream import split_at_character
from trtmoe.triton.threads import name_native_thread


_KEYED_CANCEL_POLL_S = 0.5  # is_cancelled polls of a generation that carries the ensemble's key


class _TritonRequest:
    """Response bookkeeping for one Triton request (B prompts share one response sender)."""

    def __init__(self, model: "TritonPythonModel", sender, gens, key: bytes | None = None):
        self.model, self.sender, self.gens = model, sender, gens
        self.key = key  # the ensemble's request key, returned on every response
        self.remaining = len(gens)
        self.lock = threading.Lock()
        # One path for all of a request's responses: built on the sender thread when any of its
        # prompts returns logits, else on the decode thread. Mixing the two within one request could
        # send a prompt's response after another prompt's final one.
        self.on_sender = any(_carries_logits(g.params) for g in gens)

    def finish_one(self) -> bool:
        with self.lock:
            self.remaining -= 1
            return self.remaining == 0


def _carries_logits(params) -> bool:
    """Whether a request's responses carry logits (arrays of vocabulary size per token)."""
    return bool(getattr(params, "return_context_logits", False) or getattr(params, "return_generation_logits", False))


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.model_name = args.get("model_name", "tensorrt_llm")
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        # torch (and what imports it) only here: Triton also imports this file in a model-level stub of
        # its own (to complete the config), which would otherwise spend seconds importing torch before
        # the instance's stub imports it again.
        import torch

        from trtmoe.runtime.engine import SamplingParams
        from trtmoe.triton.served import ServedMetrics, load_served_engine

        self.SamplingParams = SamplingParams
        try:
            served = load_served_engine(config, args["model_repository"])  # that arg is this model's folder
        except ValueError as e:
            raise pb_utils.TritonModelException(str(e)) from None
        self.engine, info, self.limits = served.engine, served.info, served.limits
        eng, cores = self.engine, served.cores
        max_input, max_seq = self.limits.max_input_len, self.limits.max_seq_len
        # context_logits / generation_logits go out in the data type config.pbtxt declares for them.
        self.logits_np = np.float16 if info.logits_triton_dtype == "TYPE_FP16" else np.float32
        self.exclude_input = _flag(config, "exclude_input_in_output", False)
        self.tokens_per_block = int(info.tokens_per_block)
        self.decode = None  # token ids -> text, to keep streamed responses on character boundaries
        tok_dir = _param(config, "tokenizer_dir")
        if tok_dir:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(os.path.join(served.resolve(tok_dir), "tokenizer.json"))
            self.decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
        # What each batcher iteration ran (the recorder wraps the engine), and the exported gauges.
        self.metrics = ServedMetrics(pb_utils, eng, config, self.model_name, str(args.get("model_version", "1")),
                                     self.tokens_per_block)
        # Batcher -> sender hand-off: appends are atomic; the sender is woken once per burst of
        # events (batcher on_flush), not once per token.
        self.outbox: deque = deque()
        self.wake = threading.Event()
        self.closing = False
        self.sender_thread = threading.Thread(target=self._send_loop, name="tensorrt_llm-sender", daemon=True)
        self.sender_thread.start()
        budget = _param(config, "prefill_budget_ms", "")
        self.batcher = InflightBatcher(
            self.metrics.recorder, max_batch_size=min(int(config["max_batch_size"]) or 1, info.max_batch_size),
            max_waiting=int(_param(config, "max_waiting_requests", "0") or 0),
            prefill_budget_s=float(budget) / 1000.0 if budget else None,
            stream_interval=max(int(_param(config, "stream_interval", "0")), 0), on_flush=self._flush,
            cpu_cores=served.decode_cores)
        self.cancel_listener = None
        try:
            from trtmoe.triton.cancel_channel import CancelListener

            self.cancel_listener = CancelListener(self.model_name,
                                                  lambda key: self.batcher.cancel(key, remember=True))
        except OSError as e:  # e.g. a second instance: `stop` requests still reach every instance
            pb_utils.Logger.log_warn(f"tensorrt_llm: no cancel channel ({e}); cancels come as stop requests only")
        self.metrics.start(self.batcher)
        pb_utils.Logger.log_info(
            f"tensorrt_llm: embedded engine {info.architecture} from {info.checkpoint_dir}, "
            f"max_batch_size={self.batcher.max_batch_size} max_input_len={max_input} max_seq_len={max_seq} "
            f"decoupled={self.decoupled} torch_threads={torch.get_num_threads()} (cores {cores})")
        served.log_binding(pb_utils.Logger)

        # What initialize loaded lives as long as the model: keep it out of the collector, whose full
        # passes over it (about 0.1 s over torch and the engine) would otherwise stall every stream.
        gc.collect()
        gc.freeze()

    # -- responses (batcher thread) ------------------------------------------------------------
    def _tensors(self, treq, gen, req, ids, final):
        ids = np.asarray(ids, dtype=np.int32).reshape(1, 1, -1)
        start = gen.sent_tokens if gen.streaming else 0
        gen.sent_tokens += ids.shape[-1] if gen.streaming else len(req.tokens)
        log_probs = self._log_probs(gen, req, start, final) if getattr(gen.params, "return_log_probs", False) else []
        out = [pb_utils.Tensor("output_ids", ids),
               pb_utils.Tensor("sequence_length", np.array([[ids.shape[-1]]], dtype=np.int32))]
        out += log_probs
        out += self._logits(gen, req, start, final)
        return out + self._extras(treq, gen, req)

    def _beam_tensors(self, treq, gen, req):
        """A beam search's response: its ranked beams (``gen.beam_results``, taken on the batcher
        thread) as TensorRT-LLM's backend returns them: output_ids [1, beams, len] padded with -1
        (the prompt first unless excluded; streamed responses carry every beam's generated tokens so
        far), sequence_length [1, beams], and with return_log_probs cum_log_probs [1, beams] (raw,
        the end id's included) and output_log_probs [1, beams, len] padded with -1."""
        hyps = gen.beam_results or []
        head = [] if gen.streaming or gen.exclude_input_in_output else list(gen.prompt_ids)
        rows = [head + list(h.tokens) for h in hyps]
        n = max((len(r) for r in rows), default=0)
        ids = np.full((1, len(rows), n), -1, dtype=np.int32)
        for i, r in enumerate(rows):
            ids[0, i, :len(r)] = r
        gen.sent_tokens = len(hyps[0].tokens) if hyps else 0
        out = [pb_utils.Tensor("output_ids", ids),
               pb_utils.Tensor("sequence_length", np.array([[len(r) for r in rows]], dtype=np.int32))]
        if getattr(gen.params, "return_log_probs", False):
            m = max((len(h.log_probs) for h in hyps), default=0)
            lps = np.full((1, len(hyps), m), -1, dtype=np.float32)
            for i, h in enumerate(hyps):
                lps[0, i, :len(h.log_probs)] = h.log_probs
            out += [pb_utils.Tensor("output_log_probs", lps),
                    pb_utils.Tensor("cum_log_probs", np.array([[h.cum_log_prob for h in hyps]], dtype=np.float32))]
        out += self._logits(gen, req, 0, True)
        return out + self._extras(treq, gen, req)

    def _extras(self, treq, gen, req):
        """The outputs every response carries beside the tokens (request key, indices, counts,
        perf metrics)."""
        out = []
        if treq.key is not None:
            out.append(pb_utils.Tensor("request_key", np.array([[treq.key]], dtype=object)))
        # Only a batched request, or one with several sequences, needs to tell its responses apart.
        if gen.batch_size > 1:
            out.append(pb_utils.Tensor("batch_index", np.array([[gen.batch_index]], dtype=np.int32)))
        if gen.batch_size > 1 or gen.num_sequences > 1:
            out.append(pb_utils.Tensor("sequence_index", np.array([[gen.sequence_index]], dtype=np.int32)))
        if gen.return_num_input_tokens:
            out.append(pb_utils.Tensor("num_input_tokens", np.array([[len(gen.prompt_ids)]], dtype=np.int32)))
        if gen.return_num_output_tokens:  # generated tokens sent so far, this response included
            out.append(pb_utils.Tensor("num_output_tokens", np.array([[gen.sent_tokens]], dtype=np.int32)))
        if gen.return_perf_metrics:  # on every response, as TensorRT-LLM's backend sends them
            off = wall_clock_offset_ns()
            for name, t in (("arrival_time_ns", req.arrival_ns), ("first_scheduled_time_ns", req.first_scheduled_ns),
                            ("first_token_time_ns", req.first_token_ns), ("last_token_time_ns", req.last_token_ns)):
                out.append(pb_utils.Tensor(name, np.array([[t + off if t else 0]], dtype=np.int64)))
            # The KV-cache row reserved for the sequence at admission, in blocks; the pool shares no
            # prefixes, so none is reused. The engine proposes no draft tokens (no speculative
            # decoding), so its draft counts are zero and so is the acceptance rate.
            new = blocks(getattr(req.seq, "kv_capacity", 0), self.tokens_per_block)
            reused = 0
            draft = accepted = 0
            for name, v in (("kv_cache_alloc_new_blocks", new), ("kv_cache_reused_blocks", reused),
                            ("kv_cache_alloc_total_blocks", new + reused), ("total_accepted_draft_tokens", accepted),
                            ("total_draft_tokens", draft)):
                out.append(pb_utils.Tensor(name, np.array([[v]], dtype=np.int32)))
            out.append(pb_utils.Tensor("acceptance_rate", np.array([[accepted / draft if draft else 0.0]],
                                                                   dtype=np.float32)))
        return out

    def _logits(self, gen, req, start, final):
        """TensorRT-LLM's logits outputs. context_logits [1, prompt, vocab] on every response (its
        results all carry them). generation_logits, the raw logits of each decoding step: unstreamed
        [1, 1, max_tokens, vocab] (rows past the steps run are zero: TensorRT-LLM's buffer is sized
        by the request's max tokens), streamed [1, n, 1, vocab] for the n tokens this response carries."""
        p, seq, out = gen.params, req.seq, []
        if getattr(p, "return_context_logits", False) and seq is not None and seq.context_logits is not None:
            ctx = seq.context_logits.numpy().astype(self.logits_np, copy=False)
            out.append(pb_utils.Tensor("context_logits", ctx[None]))
        if getattr(p, "return_generation_logits", False) and seq is not None:
            rows = seq.generation_logits
            V = int(self.engine.vocab_size)
            if gen.beam_width > 1:  # [1, beams, max_tokens, vocab], each cache slot's rows (unstreamed only)
                beams = getattr(seq, "beam_generation_logits", None)
                nb = len(gen.beam_results) or gen.beam_width
                arr = np.zeros((1, nb, gen.max_new_tokens, V), dtype=self.logits_np)
                if beams is not None:
                    n = min(beams.shape[1], gen.max_new_tokens)
                    arr[0, :, :n] = beams[:nb, :n].numpy()
                out.append(pb_utils.Tensor("generation_logits", arr))
            elif gen.streaming:
                part = rows[start:gen.sent_tokens]
                if part:
                    arr = np.stack([r.numpy() for r in part]).astype(self.logits_np, copy=False)
                    out.append(pb_utils.Tensor("generation_logits", arr.reshape(1, len(part), 1, V)))
            else:
                arr = np.zeros((1, 1, gen.max_new_tokens, V), dtype=self.logits_np)
                if rows:
                    n = min(len(rows), gen.max_new_tokens)
                    arr[0, 0, :n] = np.stack([r.numpy() for r in rows[:n]])
                out.append(pb_utils.Tensor("generation_logits", arr))
        return out

    @staticmethod
    def _log_probs(gen, req, start, final):
        """output_log_probs [1, 1, n]: the log-probability of each generated token this response
        carries (all of them unstreamed, the new ones streamed), and cum_log_probs [1, 1]: their
        running sum over the generation so far; the final one includes the end id's when the engine
        stopped on it, as TensorRT-LLM's sampler counts it."""
        seq = req.seq
        lps = getattr(seq, "log_probs", None) or []
        end = gen.sent_tokens if gen.streaming else len(req.tokens)
        cum = float(np.sum(np.asarray(lps[:end], dtype=np.float64)))
        if final and len(lps) == len(req.tokens) and len(seq.tokens) == len(req.tokens):
            cum = float(getattr(seq, "cum_log_prob", cum))
        return [pb_utils.Tensor("output_log_probs", np.asarray(lps[start:end], dtype=np.float32).reshape(1, 1, -1)),
                pb_utils.Tensor("cum_log_probs", np.array([[cum]], dtype=np.float32))]

    def _on_event(self, treq: _TritonRequest, gen, event):
        """Batcher callback (decode thread). Non-streamed requests only need their final event.

        A response is built here and only its ``send`` (an IPC round trip to tritonserver, made without
        the GIL) is left to the sender thread, so slow IPC or a slow client never holds up the decode
        loop. Building it here rather than on the sender keeps the two threads from trading the GIL
        at every response: measured with scripts/bench_peers.py, the decode thread then spends less
        CPU per token as well. Responses carrying logits (large arrays) are still built on the sender
        thread, from the event, so that they never stall the batch, and so are all responses of a
        request with any such prompt (see ``_TritonRequest.on_sender``)."""
        if not (gen.streaming or event.finished):
            return
        req = event.request
        if gen.beam_width > 1 and req.seq is not None:
            # The ranked beams now, read here on the batcher thread (the next step reorders them).
            gen.beam_results = req.seq.results()
        if treq.on_sender:
            self.outbox.append((treq, gen, event))  # the batcher's on_flush wakes the sender
            return
        try:
            for resp, flags in self._responses(treq, gen, req, event.new_tokens, event if event.finished else None):
                self.outbox.append((treq, req, resp, flags))
        except Exception as e:  # noqa: BLE001 - a response that cannot be built ends its request
            pb_utils.Logger.log_warn(f"tensorrt_llm: dropping {req.request_id}: {e}")
            req.cancel()

    def _flush(self):
        if self.outbox and not self.wake.is_set():
            self.wake.set()

    def _send_loop(self):
        """Sender thread: drains the outbox in order. Built responses are sent as they are; for a
        request whose responses carry logits, the tokens of events that piled up go out in one
        response, built here."""
        name_native_thread("trtmoe-send")
        while True:
            self.wake.wait()
            self.wake.clear()
            items = []
            while self.outbox:
                items.append(self.outbox.popleft())
            groups: dict[int, list] = {}  # logits-carrying requests' events, merged per request
            ready = []  # (treq, req, response or None, flags) in order
            for item in items:
                if len(item) == 4:
                    ready.append(item)
                    continue
                treq, gen, ev = item
                groups.setdefault(id(ev.request), [treq, gen, ev.request, [], None])
                g = groups[id(ev.request)]
                g[3].extend(ev.new_tokens)
                if ev.finished:
                    g[4] = ev
            for treq, gen, req, tokens, final in groups.values():
                try:
                    ready += [(treq, req, resp, flags) for resp, flags in self._responses(treq, gen, req, tokens, final)]
                except Exception as e:  # noqa: BLE001 - a response that cannot be built ends its request
                    pb_utils.Logger.log_warn(f"tensorrt_llm: dropping {req.request_id}: {e}")
                    req.cancel()
            for treq, req, resp, flags in ready:
                try:
                    if resp is None:
                        treq.sender.send(flags=flags)
                    else:
                        treq.sender.send(resp, flags=flags)
                except Exception as e:  # noqa: BLE001 - the client is gone: stop generating for it
                    pb_utils.Logger.log_warn(f"tensorrt_llm: dropping {req.request_id}: {e}")
                    req.cancel()
            if self.closing and not self.outbox:  # set after the batcher's last events were queued
                return

    def _responses(self, treq: _TritonRequest, gen, req, new_tokens, final) -> list:
        """The (response or None, flags) pairs to send for new tokens, or for the final event ``final``."""
        if final is not None and final.finish_reason == FINISH_ERROR:
            msg = f"generation failed: {final.error}"
            last = treq.finish_one()
            return [(pb_utils.InferenceResponse(error=pb_utils.TritonError(msg)),
                     pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0)]
        if gen.beam_width > 1:
            if final is None and not gen.streaming:
                return []
            last = final is not None and treq.finish_one()
            out = self._beam_tensors(treq, gen, req)
            return [(pb_utils.InferenceResponse(output_tensors=out),
                     pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0)]
        held = gen.held
        if final is None:
            if gen.streaming and new_tokens:
                ids = held + new_tokens
                if self.decode is not None:  # hold a character's leading bytes until it is whole
                    ids, gen.held = split_at_character(self.decode, ids)
                if ids:
                    return [(pb_utils.InferenceResponse(output_tensors=self._tensors(treq, gen, req, ids, False)), 0)]
            return []
        last = treq.finish_one()
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0
        if gen.streaming:
            ids = held + new_tokens
        else:
            ids = req.tokens if gen.exclude_input_in_output else gen.prompt_ids + req.tokens
        if gen.streaming and not ids and not (gen.return_perf_metrics or gen.return_num_output_tokens):
            return [(None, flags)] if last else []
        return [(pb_utils.InferenceResponse(output_tensors=self._tensors(treq, gen, req, ids, True)), flags)]

    # -- Triton entry points -------------------------------------------------------------------
    @staticmethod
    def _get(request):
        # One pass over the request's inputs: get_input_tensor_by_name rebuilds them on every call.
        arrays = {t.name(): t for t in request.inputs()}
        return lambda name: (lambda t: None if t is None else t.as_numpy())(arrays.get(name))

    def _submit(self, request, sender):
        get = self._get(request)
        # The generation's id: the ensemble's per-request key when it sends one (a streaming
        # postprocessing stops the generation by it), else the Triton request id.
        key = get("request_key")
        if key is not None:
            key = np.asarray(key).reshape(-1)[0]
            key = key if isinstance(key, bytes) else str(key).encode()
        gen_id = key.decode() if key else request.request_id()
        stop = get("stop")
        if stop is not None and bool(np.asarray(stop).reshape(-1)[0]):
            self.batcher.cancel(gen_id, remember=key is not None)  # a key names one generation
            return None
        gens = parse_requests(get, self.limits, self.SamplingParams,
                              default_exclude_input=self.exclude_input, decoupled=self.decoupled)
        treq = _TritonRequest(self, sender, gens, key or None)
        is_cancelled = getattr(sender, "is_cancelled", None) if sender is not None else None
        # A keyed generation is cancelled by its key (postprocessing / BLS over the cancel channel):
        # Triton never flags the ensemble's running step, so polling its sender every step (an IPC
        # round trip per request per step) would only cost; it is asked now and then, as a fallback.
        poll = _KEYED_CANCEL_POLL_S if key else None
        # All of a batched request's prompts are queued, or none (QueueFull): never half of them.
        self.batcher.submit_all([dict(prompt_ids=gen.prompt_ids, params=gen.params,
                                      callback=lambda ev, g=gen: self._on_event(treq, g, ev),
                                      stop_sequences=gen.stop_sequences, request_id=gen_id,
                                      is_cancelled=is_cancelled, cancel_poll_s=poll) for gen in gens])
        return treq

    def execute(self, requests):
        # Decoupled or not, every request is answered through its response sender, so execute
        # returns at once and the next requests join the running batch (a non-decoupled request
        # gets exactly one response: parse_requests refuses streaming and batches there).
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            sender = request.get_response_sender()
            try:
                if self._submit(request, sender) is None:  # a `stop` request
                    if self.decoupled:
                        sender.send(flags=final)
                    else:
                        sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=final)
            except RequestError as e:
                sender.send(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)), flags=final)
            except Exception as e:  # noqa: BLE001
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"tensorrt_llm: {e}")), flags=final)
        return None

    def finalize(self):
        if self.cancel_listener is not None:
            self.cancel_listener.close()
        self.metrics.stop()
        self.batcher.shutdown()
        self.closing = True
        self.wake.set()
        self.sender_thread.join(timeout=10)
