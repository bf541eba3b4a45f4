"""A hub id resolves through the local Hugging Face cache, offline, without any download."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys



def _populate_cache(cache, repo_id: str, src) -> None:
    org, name = repo_id.split("/")
    base = cache / f"models--{org}--{name}"
    rev = "0123456789abcdef0123456789abcdef01234567"
    snap = base / "snapshots" / rev
    snap.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copyfile(f, snap / f.name)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(rev)


def test_hub_id_from_local_cache(tiny_model, tmp_path):
    cache = tmp_path / "hub"
    _populate_cache(cache, "acme/tiny-mixtral", tiny_model("mixtral"))
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "ckpt"
    r = subprocess.run([sys.executable, "-m", "trtmoe.cli", "convert", "acme/tiny-mixtral", "-o", str(out)],
                       capture_output=True, text=True, env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    assert (out / "rank0.safetensors").is_file()


def test_hub_id_not_cached_is_a_clear_error(tmp_path):
    env = {"HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "trtmoe.cli", "inspect", "acme/not-there"],
                       capture_output=True, text=True, env={**os.environ, **env})
    assert r.returncode == 2
    assert "not in the local Hugging Face cache" in r.stderr
    assert "Traceback" not in r.stderr
