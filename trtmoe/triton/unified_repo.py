"""An llmapi repository of a unified-HF checkpoint, served on CPU by the embedded engine.

``trtmoe repo <unified checkpoint>`` writes upstream's llmapi layout: ``tensorrt_llm/config.pbtxt`` and
``tensorrt_llm/1/model.yaml`` (``LLM()`` arguments: ``model`` names the checkpoint, ``max_batch_size``,
``max_seq_len``, ``triton_config.decoupled``); on a GPU host upstream's ``model.py`` (TensorRT-LLM's
container, ``triton_backend/all_models/llmapi/tensorrt_llm/1/model.py``) goes beside model.yaml and
TensorRT-LLM's PyTorch backend loads the checkpoint.

Where no ``model.py`` was put there (a CPU host), ``trtmoe serve`` serves the same repository with the
embedded engine instead: from model.yaml it makes an embedded engine directory whose checkpoint is the
unified-HF checkpoint (``trtmoe.runtime.unified_load`` loads it from its packed bytes) and writes trtmoe's
llmapi-layout repository for it (``trtmoe.triton.repository``, ``layout="llmapi"``): one ``tensorrt_llm``
model with the inputs and outputs of upstream's llmapi model (``text_input``, ``streaming``,
``sampling_param_*`` in; ``text_output``, ``finish_reason`` ... out), decoupled as model.yaml's
``triton_config`` says. The checkpoint is read where model.yaml points; nothing is copied.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from ..checkpoint.manifest import REPOSITORY_MANIFEST
from ..errors import InputError
from ..runtime.unified_load import UnifiedCheckpoint, is_unified_checkpoint
from .repository import RepositoryResult, generate_repository

MODEL_YAML = Path("tensorrt_llm") / "1" / "model.yaml"
UPSTREAM_MODEL_PY = Path("tensorrt_llm") / "1" / "model.py"
# Limits when model.yaml gives none (LLM()'s max_seq_len defaults to the model's context).
DEFAULT_MAX_BATCH_SIZE = 8


def is_unified_llmapi_repository(repo: str | Path) -> bool:
    """A repository ``trtmoe repo`` wrote for a unified-HF checkpoint (its manifest's contract)."""
    try:
        man = json.loads((Path(repo) / REPOSITORY_MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(man, dict) and man.get("layout") == "llmapi" and \
        str(man.get("contract", "")).endswith("(PyTorch backend)")


def needs_embedded_engine(repo: str | Path) -> bool:
    """Whether ``trtmoe serve`` runs this repository with the embedded engine: an llmapi repository of a
    unified-HF checkpoint that has no upstream ``model.py`` beside its model.yaml."""
    return is_unified_llmapi_repository(repo) and not (Path(repo) / UPSTREAM_MODEL_PY).is_file()


def read_model_yaml(repo: str | Path) -> dict:
    f = Path(repo) / MODEL_YAML
    try:
        y = yaml.safe_load(f.read_text())
    except OSError as e:
        raise InputError(f"cannot read model.yaml: {e.strerror}", where=str(f)) from None
    except yaml.YAMLError as e:
        raise InputError(f"model.yaml is not valid YAML: {str(e).splitlines()[0]}", where=str(f)) from None
    if not isinstance(y, dict) or not isinstance(y.get("model"), str):
        raise InputError("model.yaml names no model (the checkpoint directory)", where=str(f))
    return y


def _positive(y: dict, key: str, default: int | None, where: str) -> int | None:
    v = y.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InputError(f"{key} must be a positive integer, got {v!r}", where=where)
    return v


def embedded_repository(repo: str | Path, work: str | Path, *, torch_num_threads: int = 0) -> RepositoryResult:
    """Under ``work`` (a new directory): an embedded engine directory for the checkpoint ``repo``'s
    model.yaml names, and trtmoe's llmapi repository for it (``work/repository``), limits and decoupling
    from model.yaml. Raises InputError naming what is wrong."""
    repo, work = Path(repo), Path(work)
    where = str(repo / MODEL_YAML)
    y = read_model_yaml(repo)
    ck = Path(y["model"]).expanduser()
    if not ck.is_absolute():
        ck = (repo / ck).resolve()
    if not is_unified_checkpoint(ck):
        raise InputError("model.yaml's model is not a unified-HF checkpoint directory", where=str(ck),
                         hint="convert with --target trtllm-pytorch and write the repository again")
    uck = UnifiedCheckpoint(ck)
    context = uck.spec.max_position_embeddings
    uck.close()
    max_seq = min(_positive(y, "max_seq_len", context, where), context)
    batch = _positive(y, "max_batch_size", DEFAULT_MAX_BATCH_SIZE, where)
    tc = y.get("triton_config") or {}
    decoupled = bool(tc.get("decoupled", False)) if isinstance(tc, dict) else False
    engine = work / "engine"
    engine.mkdir(parents=True)
    build = {"max_batch_size": batch, "max_input_len": max(1, max_seq - 1), "max_seq_len": max_seq,
             "max_beam_width": 1, "tokens_per_block": 32, "device": "cpu", "cpu_matmul": "auto",
             "cpu_activations": "float32"}
    (engine / "config.json").write_text(json.dumps({"backend": "embedded", "checkpoint": str(ck),
                                                    "build_config": build}, indent=2) + "\n")
    return generate_repository(engine, work / "repository", layout="llmapi", streaming=decoupled, device="cpu",
                               torch_num_threads=torch_num_threads)
