"""``trtmoe convert``: stream an HF MoE checkpoint into a TensorRT-LLM checkpoint directory.

Memory stays bounded by one tensor chunk (one expert slice for stacked expert tensors): every rank
file is written header-first from the layout specs, then tensor by tensor in order.
"""

from __future__ import annotations

import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import DEFAULT_TRTLLM_VERSION
from ..errors import CheckpointError
from ..hf.reader import HFCheckpoint, parse_dtype
from ..hf.safetensors_io import StreamingWriter, iter_chunks, sha256_file
from ..parallel.mapping import Mapping
from .atomic import atomic_directory
from .layout import DTYPE_STR, TensorSpec, rank_specs, trtllm_config
from .manifest import dump_json, write_manifest
from .schema import check_strict_blocks


@dataclass
class ConvertResult:
    out_dir: Path
    mapping: Mapping
    dtype: str
    files: dict[str, str] = field(default_factory=dict)
    bytes_written: int = 0
    rank_bytes: list[int] = field(default_factory=list)


def resolve_dtype(src: HFCheckpoint, dtype: str) -> torch.dtype:
    """``auto`` keeps the source dtype (fp32 stays fp32); otherwise the named dtype."""
    if dtype == "auto":
        name = src.model.source_dtype
        return parse_dtype(name if name in DTYPE_STR.values() else "float32")
    return parse_dtype(dtype)


class _SourceHasher(threading.Thread):
    """Hashes the source files in the background while conversion runs (hashlib drops the GIL)."""

    def __init__(self, files: list[Path]):
        super().__init__(daemon=True)
        self.files, self.hashes, self.error = files, {}, None

    def run(self):
        try:
            for f in self.files:
                self.hashes[f.name] = sha256_file(f)
        except Exception as e:  # noqa: BLE001 - surfaced after join
            self.error = e


def write_rank(path: Path, specs: list[TensorSpec], progress: Callable[[int], None] | None = None) -> str:
    w = StreamingWriter(path, [(s.name, s.dtype, s.shape) for s in specs], {"format": "pt"})
    try:
        for s in specs:
            def emit(t: torch.Tensor, s=s):
                if t.dtype != s.dtype:
                    t = t.to(s.dtype)
                for chunk in iter_chunks(t):
                    w.write(chunk)
                    if progress:
                        progress(chunk.nbytes)
            s.produce(emit)
            if w._idx < len(specs) and w.current[0] == s.name:
                raise CheckpointError(f"produced too few bytes for {s.name}")
        return w.close()
    except BaseException:
        w.abort()
        raise


def _copy_tokenizer(src_dir: Path, out: Path) -> None:
    """Keep the tokenizer beside the weights (TensorRT-LLM ignores the extra folder) so later stages
    can find it without another path."""
    from ..runtime.load import TOKENIZER_FILES

    files = [src_dir / n for n in TOKENIZER_FILES if (src_dir / n).is_file()]
    if any(f.name == "tokenizer.json" for f in files):
        (out / "tokenizer").mkdir()
        for f in files:
            shutil.copyfile(f, out / "tokenizer" / f.name)


def convert(model: str | Path, out_dir: str | Path, *, tp: int = 1, pp: int = 1, moe_tp: int | None = None,
            moe_ep: int | None = None, dtype: str = "auto", trtllm_version: str = DEFAULT_TRTLLM_VERSION,
            force: bool = False, resolved_config: dict | None = None,
            progress: Callable[[int, int], None] | None = None, quant=None) -> ConvertResult:
    """Convert ``model`` (HF dir or cached hub id) into a TensorRT-LLM checkpoint at ``out_dir``.

    ``progress(done_bytes, total_bytes)`` is called as rank bytes are written. ``quant`` is an
    optional ``trtmoe.quant.plan.QuantPlan`` (format per expert, granularity, placement). Nothing is written unless the whole conversion succeeds.
    """
    with HFCheckpoint(model) as src:
        mapping = Mapping.create(tp, pp, moe_tp, moe_ep)
        mapping.validate(src.model)
        tdtype = resolve_dtype(src, dtype)
        if quant is not None:
            quant.dtype = tdtype
            quant.bind(src.model, mapping)
        quant_cfg = quant.quantization_config() if quant is not None else None
        extra = quant.config_extra() if quant is not None else None
        cfg = trtllm_config(src.model, mapping, tdtype, version=trtllm_version, quantization=quant_cfg, extra=extra)
        problems = check_strict_blocks(cfg, trtllm_version)
        assert not problems, problems  # our own tables must agree with themselves
        all_specs = [rank_specs(src.model, mapping, r, tdtype, src, quant) for r in mapping.ranks()]
        total = sum(s.nbytes for specs in all_specs for s in specs)
        done = [0]

        def tick(n: int):
            done[0] += n
            if progress:
                progress(done[0], total)

        hasher = _SourceHasher(sorted(src.path.glob("*.json")) + list(src.files))
        hasher.start()
        result = ConvertResult(Path(out_dir), mapping, DTYPE_STR[tdtype])
        with atomic_directory(out_dir, force=force) as tmp:
            dump_json(cfg, tmp / "config.json")
            if quant is not None:
                quant.write_sidecars(tmp)
            _copy_tokenizer(src.path, tmp)
            for r, specs in enumerate(all_specs):
                name = f"rank{r}.safetensors"
                result.files[name] = write_rank(tmp / name, specs, tick)
                result.rank_bytes.append(sum(s.nbytes for s in specs))
            hasher.join()
            if hasher.error:
                raise hasher.error
            write_manifest(
                tmp, kind="trtllm-checkpoint", file_hashes=result.files,
                target_trtllm_version=trtllm_version,
                source={"name": src.path.name, "architecture": src.model.hf_architecture,
                        "files": hasher.hashes},
                resolved_config=resolved_config or {
                    "tp": tp, "pp": pp, "moe_tp": mapping.moe_tp_size, "moe_ep": mapping.moe_ep_size,
                    "dtype": DTYPE_STR[tdtype], "trtllm_version": trtllm_version},
                mapping={"tp": mapping.tp_size, "pp": mapping.pp_size, "moe_tp": mapping.moe_tp_size,
                         "moe_ep": mapping.moe_ep_size, "world_size": mapping.world_size},
                quantization=(quant.manifest_entry() if quant is not None else None),
            )
        result.bytes_written = total
        return result
