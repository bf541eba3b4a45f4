"""``trtmoe build``: engine directories from checkpoints.

* ``tensorrt_llm``: the exact ``trtllm-build`` command, preflight, the run, the engine manifest.
* ``embedded``: an engine directory for the embedded PyTorch engine.
* ``preflight``: checks that run before any work; ``estimate``: memory per GPU without a GPU.
"""
