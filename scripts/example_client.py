#!/usr/bin/env python3
"""A short, copyable Triton client for a trtmoe repository (plain tritonclient, no trtmoe import).

    trtmoe serve repo/                      # in another terminal
    python scripts/example_client.py "def main(" --max-tokens 40

Works with both kinds of repository. The default one (`trtmoe repo`, not decoupled, as upstream's
templates) answers a unary ModelInfer call with the whole text; a `trtmoe repo --streaming` one
(decoupled) must be called through the gRPC stream API, and then streams the text as it is
generated. `text_output` is 1-D: the text is `output[0].decode()`. The prompt is left out
(exclude_input_in_output) so only the completion is printed.
"""

import argparse
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient


def tensor(name, array, dtype):
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def decoupled(client, model):
    """True if the model, or a step of the ensemble, streams its responses."""
    cfg = client.get_model_config(model, as_json=True)["config"]
    if cfg.get("model_transaction_policy", {}).get("decoupled"):
        return True
    steps = cfg.get("ensemble_scheduling", {}).get("step", [])
    return any(decoupled(client, s["model_name"]) for s in steps)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt")
    ap.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC endpoint")
    ap.add_argument("--model", default="ensemble")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    client = grpcclient.InferenceServerClient(args.url)
    stream = decoupled(client, args.model)
    inputs = [
        tensor("text_input", np.array([[args.prompt.encode()]], dtype=object), "BYTES"),
        tensor("max_tokens", np.array([[args.max_tokens]], dtype=np.int32), "INT32"),
        tensor("exclude_input_in_output", np.array([[True]]), "BOOL"),
        tensor("stream", np.array([[stream]]), "BOOL"),
    ]
    if not stream:
        result = client.infer(args.model, inputs)
        print(result.as_numpy("text_output")[0].decode())
        client.close()
        return
    responses = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(args.model, inputs, enable_empty_final_response=True)
    try:
        while True:
            result, error = responses.get(timeout=300)
            if error is not None:
                sys.exit(f"error: {error}")
            text = result.as_numpy("text_output")
            if text is not None:
                print(text[0].decode(), end="", flush=True)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    print()


if __name__ == "__main__":
    main()
