"""File hashes (sha256), without torch: manifests and the serving side read them too."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: str | Path, chunk: int = 8 << 20) -> str:
    """The sha256 of a file's bytes, read in ``chunk``-byte pieces into one buffer."""
    h = hashlib.sha256()
    buf = bytearray(chunk)
    mv = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(mv[:n])
    return h.hexdigest()
