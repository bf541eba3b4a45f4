"""trtmoe: Hugging Face MoE checkpoints to TensorRT-LLM checkpoints, engines and Triton repositories."""

__version__ = "0.1.0"

# The TensorRT-LLM release line whose checkpoint format we write by default.
DEFAULT_TRTLLM_VERSION = "1.2"
