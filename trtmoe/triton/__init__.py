"""The Triton stage: model-repository generator, tritonserver launcher, in-flight batcher, client.

* ``engine_dir.read_engine_dir``       - an engine directory's own limits (embedded or trtllm-build)
* ``repository.generate_repository``   - write ensemble / preprocessing / tensorrt_llm / postprocessing /
  tensorrt_llm_bls from those limits, checked with Triton's ModelConfig schema
* ``serve.serve_repository``           - start a real tritonserver (NGC container or nvidia-pytriton's CPU build)
* ``batcher.InflightBatcher``          - the embedded engine's continuous batching loop, composed of the
  pieces in ``inflight/`` (settings, shared state, token delivery, cancels, admission, the decode loop)
* ``client.generate``                  - gRPC client (stream API for decoupled models)
* ``metrics``                          - per-expert routing metrics exported by the Python backend
* ``commands``                         - the ``repo``, ``serve`` and ``generate`` click commands
"""
