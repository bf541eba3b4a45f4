#!/usr/bin/env python3
"""A short, copyable Triton client for a trtmoe repository (plain tritonclient, no trtmoe import).

    trtmoe serve repo/                      # in another terminal
    python scripts/example_client.py "def main(" --max-tokens 40

The generated `ensemble` is decoupled (it streams), so it is called through the gRPC stream API;
Triton refuses unary ModelInfer calls to decoupled models.
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt")
    ap.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC endpoint")
    ap.add_argument("--model", default="ensemble")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    inputs = [
        tensor("text_input", np.array([[args.prompt.encode()]], dtype=object), "BYTES"),
        tensor("max_tokens", np.array([[args.max_tokens]], dtype=np.int32), "INT32"),
        tensor("stream", np.array([[True]]), "BOOL"),
    ]
    responses = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(args.model, inputs, enable_empty_final_response=True)
    try:
        while True:
            result, error = responses.get(timeout=300)
            if error is not None:
                sys.exit(f"error: {error}")
            text = result.as_numpy("text_output")
            if text is not None:
                print(text.reshape(-1)[0].decode(), end="", flush=True)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    print()


if __name__ == "__main__":
    main()
