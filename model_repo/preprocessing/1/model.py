"""Triton Python model `preprocessing`: prompt text -> token ids, plus stop/bad word lists.

It also merges the sampling inputs that two template generations name differently: `min_length`
(tensorrtllm_backend <= v0.19.0) and `min_tokens` (TensorRT-LLM 1.2), `random_seed` and `seed`.
Either name is accepted (both with different values is an error) and the value goes to
tensorrt_llm's 1.2 input (`OUT_MIN_TOKENS` -> min_tokens, `OUT_SEED` -> seed).

Self-contained (numpy + the `tokenizers` library; no transformers, no torch) so it runs in any
Triton container, including the NGC TensorRT-LLM one where trtmoe itself is not installed. It reads
the repository's `tokenizer.json` and the special-token facts `trtmoe repo` resolved into
`trtmoe_tokenizer.json`. One thread: many of these processes share the machine with the engine.
"""

from __future__ import annotations

import os

for _var in ("RAYON_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gc  # noqa: E402
import json  # noqa: E402
import uuid  # noqa: E402

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

# (1.2 name, older name, output, dtype)
_ALIASES = (("MIN_TOKENS", "MIN_LENGTH", "OUT_MIN_TOKENS", np.int32), ("SEED", "RANDOM_SEED", "OUT_SEED", np.uint64))


def _param(config: dict, key: str, default: str = "") -> str:
    value = config.get("parameters", {}).get(key, {}).get("string_value", "")
    # An unfilled placeholder means "use the default", as in the upstream templates.
    return default if not value or (value.startswith("$" + "{") and value.endswith("}")) else value


def _flag(config: dict, key: str, default: bool) -> bool:
    value = _param(config, key, "").strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    return default


def resolve_tokenizer_dir(args: dict, config: dict) -> str:
    """Absolute paths are used as is; relative ones are relative to the model repository root."""
    path = _param(config, "tokenizer_dir")
    if not path:
        raise pb_utils.TritonModelException("parameter tokenizer_dir is not set")
    if not os.path.isabs(path):
        # args["model_repository"] is this model's directory; its parent is the repository root.
        path = os.path.join(os.path.dirname(os.path.abspath(args["model_repository"])), path)
    return path


def _strings(arr) -> list[str]:
    return [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in arr.reshape(-1)]


def max_token_bytes(tokenizer) -> int:
    """The UTF-8 length of the longest vocabulary entry (added tokens included): no token covers more
    bytes of text than that, so a text of more than ``n`` times as many bytes is over ``n`` tokens."""
    return max((len(t.encode("utf-8")) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1) or 1


def text_bytes(x) -> int:
    return len(x) if isinstance(x, bytes) else len(str(x).encode("utf-8"))


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        path = resolve_tokenizer_dir(args, config)
        self.tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        with open(os.path.join(path, "trtmoe_tokenizer.json")) as f:
            facts = json.load(f)
        self.add_special_tokens = _flag(config, "add_special_tokens", True)
        self.vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        limit = _param(config, "max_input_len", "0")
        self.max_input_len = int(limit) if limit.isdigit() else 0  # 0: not set (a template without it)
        # A prompt of more bytes than this is over max_input_len tokens: refused before tokenizing.
        self.max_prompt_bytes = self.max_input_len * max_token_bytes(self.tokenizer) if self.max_input_len else 0
        eos, pad = facts.get("eos_token_id"), facts.get("pad_token_id")
        self.end_id = eos if eos is not None else -1
        self.pad_id = pad if pad is not None else max(self.end_id, 0)

        # What initialize loaded lives as long as the model: keep it out of the collector, whose full
        # passes over it (several ms) would otherwise stall the responses passing through.
        gc.collect()
        gc.freeze()

    def _ids(self, text: str, special: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def _encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        ids = [self._ids(t, self.add_special_tokens) for t in texts]
        width = max(1, max(len(x) for x in ids))
        out = np.full((len(ids), width), self.pad_id, dtype=np.int32)
        for i, x in enumerate(ids):
            out[i, : len(x)] = x
        return out, np.array([[len(x)] for x in ids], dtype=np.int32)

    def _word_list(self, arr, batch: int) -> np.ndarray:
        """[batch, 2, L]: row 0 the words' ids back to back (padded 0), row 1 their end offsets (padded -1)."""
        rows = []
        for b in range(batch):
            ids, offsets = [], []
            if arr is not None:
                for word in _strings(arr[b if arr.shape[0] > 1 else 0]):
                    if not word:
                        continue
                    ids += self._ids(word, False)
                    offsets.append(len(ids))
            rows.append((ids, offsets))
        width = max(1, max(max(len(i), len(o)) for i, o in rows))
        out = np.zeros((batch, 2, width), dtype=np.int32)
        out[:, 1, :] = -1
        for b, (ids, offsets) in enumerate(rows):
            out[b, 0, : len(ids)] = ids
            out[b, 1, : len(offsets)] = offsets
        return out

    def _embedding_bias(self, words, weights, batch: int) -> np.ndarray:
        if words is None or weights is None:
            return np.zeros((batch, 0), dtype=np.float32)
        vocab = self.vocab
        out = np.zeros((batch, vocab), dtype=np.float32)
        for b in range(batch):
            ws = _strings(words[b if words.shape[0] > 1 else 0])
            vs = weights[b if weights.shape[0] > 1 else 0].reshape(-1)
            if len(ws) != len(vs):
                raise ValueError(f"embedding_bias_words has {len(ws)} entries but embedding_bias_weights {len(vs)}")
            for w, v in zip(ws, vs):
                for t in self._ids(w, False):
                    out[b, t] += float(v)
        return out

    def _one(self, request) -> "pb_utils.InferenceResponse":
        get = lambda n: (lambda t: None if t is None else t.as_numpy())(pb_utils.get_input_tensor_by_name(request, n))
        query = get("QUERY")
        if query is None:
            raise ValueError("missing input 'text_input' (QUERY)")
        out_len = get("REQUEST_OUTPUT_LEN")
        if out_len is None:
            raise ValueError("missing input 'max_tokens' (REQUEST_OUTPUT_LEN)")
        batch = query.shape[0]
        prompts = query.reshape(batch, -1)[:, 0]
        if self.max_prompt_bytes:
            longest = max(text_bytes(x) for x in prompts)
            if longest > self.max_prompt_bytes:
                raise ValueError(f"text_input is {longest} bytes, more than {self.max_input_len} tokens (this "
                                 f"engine's max_input_len) can hold: refused before tokenizing")
        input_ids, input_len = self._encode(_strings(prompts))
        decoder = get("DECODER_QUERY")
        if decoder is not None:
            dec_ids, dec_len = self._encode(_strings(decoder.reshape(batch, -1)[:, 0]))
        else:  # decoder-only engines: a one-token placeholder, as the TensorRT-LLM templates send
            dec_ids = np.full((batch, 1), self.pad_id, dtype=np.int32)
            dec_len = np.ones((batch, 1), dtype=np.int32)
        end_id, pad_id = get("END_ID"), get("PAD_ID")
        end_id = end_id.astype(np.int32) if end_id is not None else np.full((batch, 1), self.end_id, np.int32)
        pad_id = pad_id.astype(np.int32) if pad_id is not None else np.full((batch, 1), self.pad_id, np.int32)
        outputs = [
            pb_utils.Tensor("INPUT_ID", input_ids),
            pb_utils.Tensor("REQUEST_INPUT_LEN", input_len),
            pb_utils.Tensor("DECODER_INPUT_ID", dec_ids),
            pb_utils.Tensor("REQUEST_DECODER_INPUT_LEN", dec_len),
            pb_utils.Tensor("BAD_WORDS_IDS", self._word_list(get("BAD_WORDS_DICT"), batch)),
            pb_utils.Tensor("STOP_WORDS_IDS", self._word_list(get("STOP_WORDS_DICT"), batch)),
            pb_utils.Tensor("EMBEDDING_BIAS", self._embedding_bias(get("EMBEDDING_BIAS_WORDS"),
                                                                   get("EMBEDDING_BIAS_WEIGHTS"), batch)),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", out_len.astype(np.int32)),
            pb_utils.Tensor("OUT_END_ID", end_id.reshape(batch, 1)),
            pb_utils.Tensor("OUT_PAD_ID", pad_id.reshape(batch, 1)),
            # Names this request's generation: the ensemble hands it to tensorrt_llm and to
            # postprocessing, which stops the generation by it when the client cancels.
            pb_utils.Tensor("OUT_REQUEST_KEY", np.full((batch, 1), uuid.uuid4().hex.encode(), dtype=object)),
        ]
        for new, old, out_name, dtype in _ALIASES:  # only sent when given, like the inputs themselves
            a, b = get(new), get(old)
            if a is not None and b is not None and not np.array_equal(a.reshape(-1), b.reshape(-1)):
                raise ValueError(f"{new.lower()} {a.reshape(-1).tolist()} and its older name {old.lower()} "
                                 f"{b.reshape(-1).tolist()} disagree; send one of them")
            value = a if a is not None else b
            if value is not None:
                outputs.append(pb_utils.Tensor(out_name, value.astype(dtype).reshape(batch, -1)[:, :1]))
        extra = get("PROMPT_TABLE_EXTRA_ID")
        if extra is not None:  # only sent when given: the engine treats its presence as p-tuning
            vocab = self.vocab
            table = np.where(input_ids >= vocab, extra.reshape(batch, 1), 0).astype(np.uint64)
            outputs.append(pb_utils.Tensor("OUT_PROMPT_TABLE_EXTRA_IDS", table))
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except Exception as e:  # noqa: BLE001 - one bad request must not fail the others
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"preprocessing: {e}", pb_utils.TritonError.INVALID_ARG)))
        return responses
