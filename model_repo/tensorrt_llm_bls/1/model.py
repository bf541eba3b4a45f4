"""Triton Python model `tensorrt_llm_bls`: preprocessing -> tensorrt_llm -> postprocessing by BLS.

Takes the ensemble's inputs and returns its outputs. Each request is served on its own thread so
one instance streams many requests at once. While streaming with `accumulate_tokens` (the default)
every response re-decodes all tokens generated so far and sends only the new text, holding back an
incomplete UTF-8 character, so the streamed pieces always join to the non-streamed text. With
num_return_sequences each sequence (told apart by tensorrt_llm's `sequence_index`) is decoded and
streamed on its own, its responses carrying that index.

Cancellation: Triton does not pass a client's cancellation on to the requests a BLS model makes, so
each inner tensorrt_llm request gets its own unique request id and one watcher thread polls every
in-flight outer request's cancellation flag; when one is set it sends tensorrt_llm that id, over
tensorrt_llm's cancel socket (trtmoe.triton.cancel_channel, which no full request queue can refuse)
where there is one, else as a `stop` request; either ends the generation (and frees its batch slot)
before the engine's next decode step. The outer request then ends with a CANCELLED error.
Self-contained (numpy only).
"""

from __future__ import annotations

import gc
import json
import threading
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils
from trtmoe_cancel_channel import CancelSender  # copied beside this file by `trtmoe repo`

# ensemble input -> (model, input name) the ensemble wires it to
_TO_PRE = {"text_input": "QUERY", "decoder_text_input": "DECODER_QUERY", "max_tokens": "REQUEST_OUTPUT_LEN",
           "bad_words": "BAD_WORDS_DICT", "stop_words": "STOP_WORDS_DICT",
           "embedding_bias_words": "EMBEDDING_BIAS_WORDS", "embedding_bias_weights": "EMBEDDING_BIAS_WEIGHTS",
           "end_id": "END_ID", "pad_id": "PAD_ID", "prompt_table_extra_id": "PROMPT_TABLE_EXTRA_ID",
           # both template generations' names; preprocessing merges each pair
           "min_tokens": "MIN_TOKENS", "min_length": "MIN_LENGTH", "seed": "SEED", "random_seed": "RANDOM_SEED"}
_PRE_TO_LLM = {"INPUT_ID": "input_ids", "REQUEST_INPUT_LEN": "input_lengths", "DECODER_INPUT_ID": "decoder_input_ids",
               "REQUEST_DECODER_INPUT_LEN": "decoder_input_lengths", "REQUEST_OUTPUT_LEN": "request_output_len",
               "STOP_WORDS_IDS": "stop_words_list", "BAD_WORDS_IDS": "bad_words_list",
               "EMBEDDING_BIAS": "embedding_bias", "OUT_END_ID": "end_id", "OUT_PAD_ID": "pad_id",
               "OUT_PROMPT_TABLE_EXTRA_IDS": "prompt_table_extra_ids", "OUT_MIN_TOKENS": "min_tokens",
               "OUT_SEED": "seed"}
_TO_LLM = {"top_k": "runtime_top_k", "top_p": "runtime_top_p", "length_penalty": "len_penalty", "stream": "streaming"}
_DIRECT = ("exclude_input_in_output", "temperature", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "return_log_probs", "return_context_logits", "return_generation_logits",
           "return_perf_metrics", "return_num_input_tokens", "return_num_output_tokens", "num_return_sequences",
           "beam_width", "prompt_embedding_table", "prompt_vocab_size", "lora_task_id", "lora_weights", "lora_config",
           "guided_decoding_guide_type", "guided_decoding_guide")
_PASS_OUTPUTS = ("cum_log_probs", "output_log_probs", "context_logits", "generation_logits", "batch_index",
                 "sequence_index", "kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks",
                 "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns",
                 "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "num_input_tokens",
                 "num_output_tokens")
_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class _Cancelled(Exception):
    """The client cancelled the request; tensorrt_llm was told to stop."""


class _Inflight:
    """An outer request being served. `lock` is held around every is_cancelled() poll and when the
    request is closed, so no poll reaches a request whose final response was sent (Triton 2.51's
    server then reads freed memory and crashes)."""

    def __init__(self, request):
        self.request, self.stopped, self.closed = request, False, False
        self.lock = threading.Lock()


def _param(config: dict, key: str, default: str = "") -> str:
    value = config.get("parameters", {}).get(key, {}).get("string_value", "")
    return default if not value or (value.startswith("$" + "{") and value.endswith("}")) else value


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.accumulate = _param(config, "accumulate_tokens", "true").lower() in ("true", "1", "yes")
        self.llm = _param(config, "tensorrt_llm_model_name", "tensorrt_llm")
        self.pre = _param(config, "preprocessing_model_name", "preprocessing")
        self.post = _param(config, "postprocessing_model_name", "postprocessing")
        self.threads: set[threading.Thread] = set()
        self.lock = threading.Lock()
        # inner tensorrt_llm request id -> _Inflight; read by the watcher thread
        self.inflight: dict[str, _Inflight] = {}
        self.sender = CancelSender(self.llm)
        self.cancel_poll_s = float(_param(config, "cancellation_check_period_ms", "50")) / 1000.0
        self.closing = threading.Event()
        self.watcher = threading.Thread(target=self._watch_cancellation, name="bls-cancel-watch", daemon=True)
        self.watcher.start()

        # What initialize loaded lives as long as the model: keep it out of the collector, whose full
        # passes over it (several ms) would otherwise stall the responses passing through.
        gc.collect()
        gc.freeze()

    # -- cancellation (watcher thread) ---------------------------------------------------------
    def _watch_cancellation(self):
        while not self.closing.wait(self.cancel_poll_s):
            with self.lock:
                entries = [(k, v) for k, v in self.inflight.items() if not v.stopped]
            for inner_id, entry in entries:
                with entry.lock:
                    if entry.closed:  # its final response may be out: never ask Triton about it again
                        continue
                    try:
                        cancelled = entry.request.is_cancelled()
                    except Exception:  # noqa: BLE001 - the request is gone: nobody waits for it
                        cancelled = True
                if cancelled:
                    entry.stopped = True
                    self._stop(inner_id)

    def _stop(self, inner_id: str):
        """Ask tensorrt_llm to end the generation with this id: over its cancel socket, else by a
        request with `stop` set."""
        if self.sender is not None:
            try:
                self.sender.send(inner_id)
                return
            except OSError:  # nobody listens (TensorRT-LLM's C++ backend): the stop request below
                pass
        inputs = [pb_utils.Tensor("input_ids", np.zeros([1, 1], np.int32)),
                  pb_utils.Tensor("input_lengths", np.zeros([1, 1], np.int32)),
                  pb_utils.Tensor("request_output_len", np.zeros([1, 1], np.int32)),
                  pb_utils.Tensor("stop", np.array([[True]], dtype=bool))]
        try:
            req = pb_utils.InferenceRequest(model_name=self.llm, requested_output_names=[], inputs=inputs,
                                            request_id=inner_id)
            for resp in req.exec(decoupled=True):
                if resp.has_error():
                    pb_utils.Logger.log_warn(f"tensorrt_llm_bls: stop of {inner_id} failed: {resp.error().message()}")
        except Exception as e:  # noqa: BLE001 - best effort: the generation then runs to its end
            pb_utils.Logger.log_warn(f"tensorrt_llm_bls: stop of {inner_id} failed: {e}")

    def _bls(self, model, names, tensors, *, decoupled=False):
        req = pb_utils.InferenceRequest(model_name=model, requested_output_names=list(names), inputs=tensors)
        return req.exec(decoupled=decoupled)

    def _check(self, response, model):
        if response.has_error():
            raise RuntimeError(response.error().message())
        return response

    def _detok(self, ids: np.ndarray) -> str:
        tokens = np.asarray(ids, dtype=np.int32).reshape(1, 1, -1)
        resp = self._check(self._bls(self.post, ["OUTPUT"], [
            pb_utils.Tensor("TOKENS_BATCH", tokens),
            pb_utils.Tensor("SEQUENCE_LENGTH", np.array([[tokens.shape[-1]]], dtype=np.int32))]), self.post)
        return pb_utils.get_output_tensor_by_name(resp, "OUTPUT").as_numpy().reshape(-1)[0].decode("utf-8")

    def _detok_beams(self, ids: np.ndarray, lengths: np.ndarray) -> list[bytes]:
        """One text per beam of a beam search's output_ids [1, beams, len] (padded with -1 past each
        beam's sequence_length), in one postprocessing call."""
        resp = self._check(self._bls(self.post, ["OUTPUT"], [
            pb_utils.Tensor("TOKENS_BATCH", np.maximum(np.asarray(ids, dtype=np.int32), 0)),
            pb_utils.Tensor("SEQUENCE_LENGTH", np.asarray(lengths, dtype=np.int32).reshape(1, -1))]), self.post)
        return list(pb_utils.get_output_tensor_by_name(resp, "OUTPUT").as_numpy().reshape(-1))

    def _generate(self, request, send):
        get = lambda n: pb_utils.get_input_tensor_by_name(request, n)
        text = get("text_input")
        if text is None:
            raise ValueError("missing input 'text_input'")
        if text.as_numpy().shape[0] != 1:
            raise ValueError("tensorrt_llm_bls takes one prompt per request; send a batch to the ensemble instead")
        pre_inputs = [pb_utils.Tensor(_TO_PRE[k], get(k).as_numpy()) for k in _TO_PRE if get(k) is not None]
        pre = self._check(self._bls(self.pre, list(_PRE_TO_LLM), pre_inputs), self.pre)
        llm_inputs = []
        for out_name, in_name in _PRE_TO_LLM.items():
            t = pb_utils.get_output_tensor_by_name(pre, out_name)
            if t is not None:
                arr = t.as_numpy()
                if in_name in ("input_lengths", "request_output_len", "decoder_input_lengths", "end_id", "pad_id",
                               "min_tokens", "seed"):
                    arr = arr.reshape(arr.shape[0], 1)
                llm_inputs.append(pb_utils.Tensor(in_name, arr))
        for k, v in list(_TO_LLM.items()) + [(d, d) for d in _DIRECT]:
            t = get(k)
            if t is not None:
                llm_inputs.append(pb_utils.Tensor(v, t.as_numpy()))
        stream = get("stream")
        streaming = bool(stream is not None and stream.as_numpy().reshape(-1)[0])
        if streaming and not self.decoupled:
            raise ValueError("streaming needs the decoupled tensorrt_llm_bls model")
        nrs, beams = get("num_return_sequences"), get("beam_width")
        beam_search = beams is not None and int(beams.as_numpy().reshape(-1)[0]) > 1  # its beams come in one response
        if nrs is not None and not self.decoupled and not beam_search and int(nrs.as_numpy().reshape(-1)[0]) > 1:
            raise ValueError("num_return_sequences > 1 sends one response per sequence: it needs the decoupled "
                             "tensorrt_llm_bls model")
        outputs = ["output_ids", "sequence_length", *_PASS_OUTPUTS]
        inner_id = f"{request.request_id() or 'bls'}#{uuid.uuid4().hex}"
        entry = _Inflight(request)
        with self.lock:
            self.inflight[inner_id] = entry
        try:
            self._relay(llm_inputs, outputs, inner_id, entry, streaming, send)
        finally:
            with entry.lock:  # before the final response: a poll in progress ends first
                entry.closed = True
            with self.lock:
                self.inflight.pop(inner_id, None)

    def _relay(self, llm_inputs, outputs, inner_id, entry, streaming, send):
        req = pb_utils.InferenceRequest(model_name=self.llm, requested_output_names=list(outputs), inputs=llm_inputs,
                                        request_id=inner_id)
        responses = req.exec(decoupled=True)
        streams: dict[int, list] = {}  # sequence_index -> [tokens so far, text sent so far]
        indexed = False  # tensorrt_llm tells the sequences apart (num_return_sequences > 1)
        for resp in responses:
            if entry.stopped:  # cancelled: drain tensorrt_llm's last responses, send nothing more
                continue
            self._check(resp, self.llm)
            ids_t = pb_utils.get_output_tensor_by_name(resp, "output_ids")
            if ids_t is None:  # a flag-only final response
                continue
            passthrough = [pb_utils.Tensor(n, t.as_numpy()) for n in _PASS_OUTPUTS
                           if (t := pb_utils.get_output_tensor_by_name(resp, n)) is not None]
            arr = ids_t.as_numpy()
            if arr.ndim == 3 and arr.shape[1] > 1:
                # Beam search: every response carries each beam's tokens so far (streamed or not), so
                # each one is decoded whole: text_output holds one string per beam.
                lengths = pb_utils.get_output_tensor_by_name(resp, "sequence_length").as_numpy()
                texts = self._detok_beams(arr, lengths)
                send(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("text_output", np.array(texts, dtype=object)), *passthrough]))
                continue
            ids = arr.reshape(-1).tolist()
            if streaming and self.accumulate:
                seq_t = pb_utils.get_output_tensor_by_name(resp, "sequence_index")
                indexed = indexed or seq_t is not None
                st = streams.setdefault(int(seq_t.as_numpy().reshape(-1)[0]) if seq_t is not None else 0, [[], ""])
                st[0] += ids
                full = self._detok(np.array(st[0]))
                # Hold back a trailing partial character until the tokens that complete it arrive.
                stable = full.rstrip("\ufffd")
                text = stable[len(st[1]):] if stable.startswith(st[1]) else ""
                st[1] = stable if stable.startswith(st[1]) else st[1]
            else:
                text = self._detok(np.array(ids))
            send(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=object)), *passthrough]))
        if entry.stopped:
            raise _Cancelled()
        for seq_idx, (tokens, sent) in streams.items():
            if not tokens:
                continue
            rest = self._detok(np.array(tokens))  # a sequence that ended inside a character
            if rest.startswith(sent) and len(rest) > len(sent):
                extra = [pb_utils.Tensor("sequence_index", np.array([[seq_idx]], dtype=np.int32))] if indexed else []
                send(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("text_output", np.array([rest[len(sent):].encode("utf-8")], dtype=object)),
                    *extra]))

    def _serve(self, request):
        sender = request.get_response_sender()
        try:
            self._generate(request, sender.send)
            sender.send(flags=_FINAL)
        except _Cancelled:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                "tensorrt_llm_bls: request cancelled", pb_utils.TritonError.CANCELLED)), flags=_FINAL)
        except Exception as e:  # noqa: BLE001 - report to the client, keep serving
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"tensorrt_llm_bls: {e}")), flags=_FINAL)
        finally:
            with self.lock:
                self.threads.discard(threading.current_thread())

    def execute(self, requests):
        if self.decoupled:
            for request in requests:
                t = threading.Thread(target=self._serve, args=(request,), daemon=True)
                with self.lock:
                    self.threads.add(t)
                t.start()
            return None
        responses = []
        for request in requests:
            try:
                collected = []
                self._generate(request, collected.append)
                responses.append(collected[-1] if collected else pb_utils.InferenceResponse(output_tensors=[]))
            except _Cancelled:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    "tensorrt_llm_bls: request cancelled", pb_utils.TritonError.CANCELLED)))
            except Exception as e:  # noqa: BLE001
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"tensorrt_llm_bls: {e}")))
        return responses

    def finalize(self):
        self.closing.set()
        with self.lock:
            threads = list(self.threads)
        for t in threads:
            t.join(timeout=5)
