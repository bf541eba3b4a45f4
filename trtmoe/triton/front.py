"""A small HTTP/1.1 front before tritonserver's HTTP endpoint that refuses oversized request bodies.

tritonserver 2.51 (the nvidia-pytriton binary) has no request-size option, and a large HTTP body is
parsed in full before any model sees it (an open upstream report has one generate request of 4 MB
end the server). ``trtmoe serve`` therefore listens on the public HTTP port itself and passes each
connection to tritonserver's HTTP port on 127.0.0.1, after reading every request's header:

* a ``Content-Length`` over ``max_body_bytes`` is answered ``413`` (Triton's JSON error shape) and
  the connection closed, before one byte of the body is read or forwarded;
* a chunked body is forwarded chunk by chunk and cut off with ``413`` once it passes the limit;
* a header block over 64 KiB is answered ``431``; both ``Content-Length`` and chunked, or a
  malformed length, ``400`` (no request can be framed differently by the front and the server);
* while tritonserver is down (a restart) a request gets ``503`` at once.

Everything else passes through byte for byte in both directions (keep-alive, ``Expect:
100-continue``, streamed ``generate_stream`` responses); one upstream connection per client
connection, so responses keep their order. gRPC and metrics are not behind it."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

HEADER_LIMIT = 64 * 1024
_PIECE = 256 * 1024
# After a 413 the rest of the body is read and dropped (never parsed, never forwarded), up to this
# many bytes or seconds, so that the client, still sending, reads the answer instead of a reset.
DISCARD_BYTES = 256 * 2**20
DISCARD_SECONDS = 30.0


def _response(code: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": message}).encode()
    return (f"HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


class _Refuse(Exception):
    def __init__(self, code: int, reason: str, message: str, discard: int = 0):
        super().__init__(message)
        self.payload = _response(code, reason, message)
        self.discard = discard  # body bytes the client is still sending


def _framing(head: bytes, limit: int) -> tuple[int | None, bool]:
    """(Content-Length or None, chunked) of a request header block; _Refuse for what is not allowed."""
    length, chunked = None, False
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        name, value = name.strip().lower(), value.strip()
        if name == b"content-length":
            if not value.isdigit() or (length is not None and int(value) != length):
                raise _Refuse(400, "Bad Request", "malformed Content-Length")
            length = int(value)
        elif name == b"transfer-encoding":
            if value.lower() != b"chunked":
                raise _Refuse(400, "Bad Request", f"unsupported Transfer-Encoding {value.decode('latin-1')!r}")
            chunked = True
    if chunked and length is not None:
        raise _Refuse(400, "Bad Request", "both Content-Length and chunked Transfer-Encoding")
    if length is not None and length > limit:
        raise _Refuse(413, "Payload Too Large", f"request body of {length} bytes is over this server's limit of "
                                               f"{limit} bytes", discard=length)
    return length, chunked


class BodyLimitFront:
    """Listen on (``host``, ``port``) and forward to 127.0.0.1:``upstream_port``, refusing request
    bodies over ``max_body_bytes``. ``start()`` binds at once (a port in use raises OSError there)
    and serves from a thread of its own; ``stop()`` closes it. ``refused`` counts 413 answers."""

    def __init__(self, host: str, port: int, upstream_port: int, max_body_bytes: int):
        self.host, self.upstream_port, self.limit = host, upstream_port, int(max_body_bytes)
        self.sock = socket.create_server((host, port))
        self.port = self.sock.getsockname()[1]
        self.refused = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "BodyLimitFront":
        ready = threading.Event()

        def run():
            loop = self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            server = loop.run_until_complete(asyncio.start_server(self._client, sock=self.sock, limit=HEADER_LIMIT))
            ready.set()
            try:
                loop.run_forever()
            finally:
                server.close()
                tasks = asyncio.all_tasks(loop)
                for task in tasks:
                    task.cancel()
                if tasks:
                    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
                loop.close()

        self._thread = threading.Thread(target=run, name="trtmoe-http-front", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        try:
            self.sock.close()
        except OSError:
            pass

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_w = None
        pipe = None
        try:
            try:
                up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port, limit=HEADER_LIMIT)
            except OSError:
                writer.write(_response(503, "Service Unavailable", "tritonserver is not running (restarting?)"))
                return
            pipe = asyncio.ensure_future(self._pipe(up_r, writer))
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:  # the client is done sending: let the answers finish
                    if up_w.can_write_eof():
                        up_w.write_eof()
                    await pipe
                    return
                except asyncio.LimitOverrunError:
                    raise _Refuse(431, "Request Header Fields Too Large", f"request header over {HEADER_LIMIT} bytes")
                length, chunked = _framing(head, self.limit)
                up_w.write(head)
                if chunked:
                    await self._chunks(reader, up_w)
                else:
                    left = length or 0
                    while left:
                        piece = await reader.read(min(left, _PIECE))
                        if not piece:
                            raise ConnectionResetError("client closed mid-body")
                        up_w.write(piece)
                        left -= len(piece)
                        await up_w.drain()
                await up_w.drain()
        except _Refuse as e:
            if e.payload.startswith(b"HTTP/1.1 413"):
                self.refused += 1
            if pipe is not None:
                pipe.cancel()
            writer.write(e.payload)
            try:
                await writer.drain()
                await asyncio.wait_for(self._discard(reader, min(e.discard, DISCARD_BYTES)), DISCARD_SECONDS)
            except (ConnectionError, OSError, asyncio.TimeoutError):
                pass
        except (ConnectionError, OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                asyncio.CancelledError):
            pass  # the client went away, or sent a chunk line no server would read: the connection ends
        finally:
            if pipe is not None and not pipe.done():
                pipe.cancel()
            for w in (up_w, writer):
                if w is not None:
                    try:
                        w.close()
                    except (ConnectionError, OSError, RuntimeError):
                        pass

    @staticmethod
    async def _discard(reader: asyncio.StreamReader, n: int) -> None:
        while n > 0:
            piece = await reader.read(min(n, _PIECE))
            if not piece:
                return
            n -= len(piece)

    async def _chunks(self, reader: asyncio.StreamReader, up_w: asyncio.StreamWriter) -> None:
        total = 0
        while True:
            line = await reader.readuntil(b"\r\n")
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise _Refuse(400, "Bad Request", "malformed chunk size") from None
            total += size
            if total > self.limit:
                raise _Refuse(413, "Payload Too Large", f"request body over this server's limit of {self.limit} bytes",
                              discard=DISCARD_BYTES)
            up_w.write(line)
            if size == 0:  # trailers, then the blank line
                while True:
                    t = await reader.readuntil(b"\r\n")
                    up_w.write(t)
                    if t == b"\r\n":
                        return
            left = size + 2  # the data and its CRLF
            while left:
                piece = await reader.read(min(left, _PIECE))
                if not piece:
                    raise ConnectionResetError("client closed mid-chunk")
                up_w.write(piece)
                left -= len(piece)
                await up_w.drain()

    @staticmethod
    async def _pipe(up_r: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Upstream's bytes to the client until upstream closes (then the client connection is closed
        too). Cancelled, it leaves the client connection to the request side, which is answering."""
        try:
            while True:
                data = await up_r.read(_PIECE)
                if not data:
                    break
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        try:
            writer.close()
        except (ConnectionError, OSError, RuntimeError):
            pass
