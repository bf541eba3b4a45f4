"""Cancellations between the Python-backend models of one tritonserver, outside Triton's queues.

A `stop` sent to ``tensorrt_llm`` as an inference request waits in that model's request queue
behind every request already there, and a full queue (``max_queue_size``) refuses it: the
generation it should end then runs to its end and keeps its batch slot, which is exactly what an
overloaded server can least afford. So the embedded ``tensorrt_llm`` model also listens on a Unix
stream socket, and postprocessing and ``tensorrt_llm_bls`` write the keys of cancelled generations
to it; the batcher remembers each key (see ``InflightBatcher.cancel(..., remember=True)``), so a key
that arrives before its request is still applied.

The socket lives in Linux's abstract namespace (no file to create or remove: it goes away with its
process), named after the tritonserver process that the backend stubs are children of and the
listening model, so two servers never share one. Only a peer of the same user whose parent is that
same tritonserver (a sibling stub) is accepted. A frame is a 4-byte big-endian length and the key
in UTF-8. postprocessing and tensorrt_llm_bls import no trtmoe (they also run in TensorRT-LLM's
container, beside its C++ backend): the repository generator copies this module, which uses the
standard library only, next to their model.py as ``trtmoe_cancel_channel.py`` (the Python backend
puts a model's version directory on ``sys.path``). Where nobody listens (the C++ backend) they send
the `stop` request instead.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from typing import Callable

log = logging.getLogger(__name__)

MAX_KEY_BYTES = 4096
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def cancel_address(model: str, server_pid: int | None = None) -> str:
    """The abstract socket name of ``model``'s listener under tritonserver ``server_pid`` (default:
    this process's parent, i.e. the server of the stub calling it)."""
    pid = os.getppid() if server_pid is None else server_pid
    return f"\0trtmoe-cancel/{pid}/{model}"


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def encode(key: str) -> bytes:
    """One frame; OSError for a key over MAX_KEY_BYTES (the sender then falls back like a refused
    connection)."""
    data = key.encode("utf-8")
    if len(data) > MAX_KEY_BYTES:
        raise OSError(f"cancel key of {len(data)} bytes (max {MAX_KEY_BYTES})")
    return len(data).to_bytes(4, "big") + data


class CancelListener:
    """Accepts sibling stubs' connections and calls ``on_cancel(key)`` for every key they send, on
    one reader thread per connection. Raises OSError when the address is taken."""

    def __init__(self, model: str, on_cancel: Callable[[str], object], *, server_pid: int | None = None):
        self.parent = os.getppid() if server_pid is None else server_pid
        self.address = cancel_address(model, self.parent)
        self.on_cancel = on_cancel
        self.received = 0  # keys handed to on_cancel
        self.refused = 0  # connections from processes that are not siblings
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind(self.address)
            self._sock.listen(128)
        except OSError:
            self._sock.close()
            raise
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name=f"cancel-listener-{model}", daemon=True)
        self._thread.start()

    def _trusted(self, conn: socket.socket) -> bool:
        pid, uid, _ = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        return uid == os.getuid() and _parent_of(pid) == self.parent

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                continue
            try:
                trusted = self._trusted(conn)
            except OSError:
                trusted = False
            if not trusted:
                self.refused += 1
                conn.close()
                continue
            threading.Thread(target=self._read, args=(conn,), name="cancel-reader", daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as f:
            while True:
                head = f.read(4)
                if len(head) < 4:
                    return
                n = int.from_bytes(head, "big")
                if n > MAX_KEY_BYTES:
                    log.warning("cancel channel: a %d-byte key; closing that connection", n)
                    return
                data = f.read(n)
                if len(data) < n:
                    return
                try:
                    self.on_cancel(data.decode("utf-8", errors="replace"))
                    self.received += 1
                except Exception:  # noqa: BLE001 - one bad key must not end the connection
                    log.exception("cancel channel: handling a key failed")

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() in progress
        except OSError:
            pass
        self._sock.close()
        self._thread.join(5)


class CancelSender:
    """Sends keys to ``model``'s listener over one kept connection (reconnecting once when it
    broke). ``send`` raises OSError when nobody listens; the caller falls back to a `stop` request."""

    def __init__(self, model: str, *, server_pid: int | None = None, timeout_s: float = 10.0):
        self.address = cancel_address(model, server_pid)
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def send(self, key: str) -> None:
        data = encode(key)
        with self._lock:
            for attempt in (0, 1):
                if self._sock is None:
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
                    s.settimeout(self.timeout_s)
                    try:
                        s.connect(self.address)
                    except OSError:
                        s.close()
                        raise
                    self._sock = s
                try:
                    self._sock.sendall(data)
                    return
                except OSError:
                    self._sock.close()
                    self._sock = None
                    if attempt:
                        raise

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
