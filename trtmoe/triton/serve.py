"""Start a real ``tritonserver`` on a model repository and wait until it is ready.

Two installations are supported:

* **pytriton** (CPU machines): the Triton 2.51 binary shipped in the ``nvidia-pytriton`` wheel, with
  its Python backend. The backend folder is assembled in a private workspace (the backend library,
  ``triton_python_backend_utils.py`` and the stub built for this interpreter's Python version); the
  wheel's files are not modified. The Python models run in *this* environment's installation: the
  stub's interpreter runs isolated (it ignores ``PYTHONPATH``, which is still set to this
  interpreter's ``sys.path`` for anything else the server starts), so torch, transformers and trtmoe
  import from this interpreter's site-packages (``pip install -e .`` counts). ``LD_LIBRARY_PATH``
  puts this interpreter's ``libpython`` ahead of any system copy (the stub links ``libpython3.X.so``
  by name) plus the wheel's bundled libraries, and ``PATH`` starts with this interpreter's bin dir.
* **system** (the NGC ``tritonserver:<yy.mm>-trtllm-python-py3`` container): ``tritonserver`` from
  ``PATH`` with its own backends. A TensorRT engine with ``world_size`` ranks runs under
  ``mpirun -n 1 tritonserver ... : -n 1 tritonserver ...`` (ranks > 0 load only ``tensorrt_llm``),
  as TensorRT-LLM's ``launch_triton_server.py`` does.

The server binds to 127.0.0.1 by default, runs in its own process group and is sent SIGINT, then
SIGKILL after a grace period, on ``stop()``; started from the main thread, it also receives SIGTERM
if this process dies (Linux), so no server or backend stub outlives its launcher.

Supervision: Triton 2.51's Python backend neither restarts a dead stub process of a decoupled model
nor reports it (health/ready stay 200, in-flight requests never get an answer). Once the server is
ready, a watchdog thread records every backend stub of the server's process group and checks them
(and the server) twice a second; when one dies it marks the server failed (``failure``), kills the
whole group at once (so clients holding in-flight requests get a connection error instead of a
hang, and health/ready stop answering) and removes the server's shared-memory regions. ``trtmoe
serve`` then exits non-zero with the reason; ``restart()`` starts the same server again.
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ..checkpoint.atomic import own_directory, pid_alive
from ..errors import BackendUnavailable, InputError, TrtmoeError
from ..checkpoint.manifest import read_repository_manifest
from . import cpu_binding
from .front import BodyLimitFront

PYTRITON = "pytriton"
SYSTEM = "system"


@dataclass(frozen=True)
class TritonInstall:
    """Where a tritonserver binary and its backends live."""

    kind: str  # PYTRITON or SYSTEM
    binary: Path
    backends_dir: Path | None  # None: the binary's built-in default (/opt/tritonserver/backends)
    lib_dirs: tuple[Path, ...] = ()
    stub: Path | None = None  # python backend stub for this interpreter (pytriton only)
    version: str | None = None


def _pytriton_install() -> TritonInstall | None:
    try:
        import pytriton  # noqa: F401
    except ImportError:
        return None
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    binary = root / "bin" / "tritonserver"
    if not binary.is_file():
        return None
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / py / "triton_python_backend_stub"
    libs = root.parent.parent / "nvidia_pytriton.libs"
    return TritonInstall(kind=PYTRITON, binary=binary, backends_dir=root / "backends",
                         lib_dirs=(libs,) if libs.is_dir() else (), stub=stub if stub.is_file() else None,
                         version="2.51.0")


def find_tritonserver(prefer: str | None = None) -> TritonInstall:
    """Locate a server: ``prefer`` = "system", "pytriton" or None (system tritonserver first, as inside
    the NGC container, then the nvidia-pytriton wheel's)."""
    order = [prefer] if prefer else [SYSTEM, PYTRITON]
    for kind in order:
        if kind == SYSTEM:
            found = shutil.which("tritonserver")
            if found:
                return TritonInstall(kind=SYSTEM, binary=Path(found), backends_dir=None)
        elif kind == PYTRITON:
            inst = _pytriton_install()
            if inst is not None:
                return inst
        else:
            raise InputError(f"unknown server kind {kind!r}", hint="use 'system' or 'pytriton'")
    raise BackendUnavailable("no tritonserver found",
                             hint="run inside the NGC tritonserver container, or `pip install nvidia-pytriton==0.7.0` "
                                  "for the CPU server")


def prepare_backends(install: TritonInstall, workspace: Path) -> Path | None:
    """For pytriton, assemble ``workspace/backends/python`` with the stub for this Python; returns
    the backend directory to pass to ``--backend-directory`` (None for a system install)."""
    if install.kind != PYTRITON:
        return install.backends_dir
    if install.stub is None:
        raise BackendUnavailable(
            f"nvidia-pytriton ships no Python backend stub for Python {sys.version_info.major}.{sys.version_info.minor}")
    dst = workspace / "backends" / "python"
    dst.mkdir(parents=True, exist_ok=True)
    src = install.backends_dir / "python"
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, dst / f.name)
    shutil.copy2(install.stub, dst / "triton_python_backend_stub")
    return dst.parent


def _libpython_dir() -> Path | None:
    libdir = sysconfig.get_config_var("LIBDIR")
    name = sysconfig.get_config_var("LDLIBRARY") or ""
    if libdir and name and (Path(libdir) / name).exists():
        return Path(libdir)
    return None


def server_environment(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver so that Python-backend models run in this interpreter's env."""
    env = dict(os.environ if base is None else base)
    if install.kind != PYTRITON:
        return env
    libpython = _libpython_dir()
    if libpython is None:
        raise BackendUnavailable(
            f"this Python ({sys.executable}) has no shared libpython; the Triton Python backend stub needs one",
            hint="use a Python built with --enable-shared (pyenv: PYTHON_CONFIGURE_OPTS=--enable-shared)")
    lib_dirs = [str(libpython)] + [str(p) for p in install.lib_dirs]
    if env.get("LD_LIBRARY_PATH"):
        lib_dirs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(lib_dirs)
    paths = [p for p in sys.path if p and Path(p).exists()]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    project_root = str(Path(__file__).resolve().parents[2])  # trtmoe importable even when not installed
    env["PYTHONPATH"] = ":".join(dict.fromkeys([project_root] + paths))
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


@dataclass(frozen=True)
class Endpoints:
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int

    @property
    def http(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"


def build_launch_command(repo: str | Path, install: TritonInstall, *, endpoints: Endpoints, world_size: int = 1,
                         backend_dir: Path | None = None, shm_prefix: str = "trtmoe", log_verbose: int = 0,
                         exit_timeout_s: int = 10, extra_args: Sequence[str] = (),
                         tensorrt_llm_model_name: str = "tensorrt_llm", http_host: str | None = None) -> list[str]:
    """The argv that starts the server. ``world_size`` > 1 (TensorRT engines) gives one MPI rank per
    engine rank; only rank 0 serves HTTP/gRPC/metrics, the others load ``tensorrt_llm`` alone.
    ``http_host``: the HTTP address when it differs from the others (behind the body-limit front)."""
    if world_size < 1:
        raise InputError(f"world_size must be >= 1, got {world_size}")

    def rank_args(rank: int) -> list[str]:
        args = [str(install.binary), f"--model-repository={Path(repo).absolute()}",
                f"--backend-config=python,shm-region-prefix-name={shm_prefix}{rank}_",
                f"--exit-timeout-secs={exit_timeout_s}"]
        if backend_dir is not None:
            args.append(f"--backend-directory={backend_dir}")
        # As the official launcher does for every rank: auto-complete off, so the written configs are
        # what Triton uses, and no Python model starts a stub of its own only to be asked for a config
        # completion (on 2 busy cores the trained fixture's streaming repository got ready in 3.3 s
        # instead of 5.8 s).
        args.append("--disable-auto-complete-config")
        if rank == 0:
            args += [f"--http-address={http_host or endpoints.host}", f"--http-port={endpoints.http_port}",
                     f"--grpc-address={endpoints.host}", f"--grpc-port={endpoints.grpc_port}",
                     f"--metrics-address={endpoints.host}", f"--metrics-port={endpoints.metrics_port}"]
        else:
            args += ["--model-control-mode=explicit", f"--load-model={tensorrt_llm_model_name}",
                     "--allow-http=false", "--allow-grpc=false", "--allow-metrics=false"]
        if log_verbose:
            args.append(f"--log-verbose={log_verbose}")
        return args + list(extra_args)

    if world_size == 1:
        return rank_args(0)
    mpirun = shutil.which("mpirun") or "mpirun"
    cmd = [mpirun, "--allow-run-as-root"]
    for rank in range(world_size):
        if rank:
            cmd.append(":")
        cmd += ["-n", "1", *rank_args(rank)]
    return cmd


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1", *, avoid: Sequence[int] = ()) -> list[int]:
    """``n`` distinct TCP ports that are free right now, none of them in ``avoid``. All sockets stay
    bound until every port is chosen: ports asked for one after another can otherwise repeat."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
            port = s.getsockname()[1]
            if port not in avoid and port not in ports:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


STUB_NAME = "triton_python_backend_stub"


def _proc_state(pid: int) -> str | None:
    """The /proc state letter of ``pid`` (R, S, Z, ...), None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def backend_stubs(pgid: int) -> dict[int, str]:
    """{pid: model instance name} of the live Python-backend stub processes in process group ``pgid``."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if int(fields[2]) != pgid or fields[0] == b"Z":
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        argv = [a.decode(errors="replace") for a in argv if a]
        if argv and argv[0].endswith(STUB_NAME):
            out[int(entry)] = argv[-2] if len(argv) >= 3 else argv[-1]  # ... <instance name> <device kind>
    return out


def shm_regions(prefix: str) -> list[str]:
    """The /dev/shm regions whose names start with ``prefix`` (a server's Python-backend regions)."""
    return sorted(glob.glob(os.path.join("/dev/shm", glob.escape(prefix) + "*"))) if prefix else []


def _shm_prefix(command: Sequence[str]) -> str:
    for arg in command:
        if "shm-region-prefix-name=" in arg:
            return arg.split("shm-region-prefix-name=", 1)[1].split(",")[0]
    return ""


def _new_group() -> None:  # runs in the child between fork and exec
    os.setsid()


def _preexec() -> None:  # runs in the child between fork and exec
    os.setsid()
    try:  # Linux: the server gets SIGTERM if its launcher dies, so it is never orphaned
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _on_cores(preexec, cores: set[int] | None):
    """``preexec`` that also starts the child on ``cores`` (None: where the launcher may run)."""
    if not cores:
        return preexec

    def run() -> None:
        preexec()
        os.sched_setaffinity(0, cores)
    return run


def decode_binding(repo: Path, manifest: dict | None = None) -> tuple[set[int], set[int]] | str | None:
    """What the repository's ``decode_cores`` setting (its manifest's) means on this machine: (the decode
    thread's cores, the cores for tritonserver and everything else), a one-line reason it cannot be
    met here, or None when the repository asks for no binding (see ``trtmoe.triton.cpu_binding``)."""
    settings = (manifest if manifest is not None else read_repository_manifest(repo)).get("settings") or {}
    return cpu_binding.plan(settings.get("decode_cores"), int(settings.get("torch_num_threads") or 1))


@dataclass
class TritonServer:
    """A running tritonserver (use ``serve_repository`` or ``with TritonServer(...) as s``)."""

    repo: Path
    endpoints: Endpoints
    install: TritonInstall
    command: list[str]
    env: dict[str, str]
    log_path: Path
    workspace: Path
    keep_workspace: bool = False
    process: subprocess.Popen | None = None
    watch_period_s: float = 0.5
    failure: str | None = None  # why the watchdog took the server down
    stubs: dict[int, str] = field(default_factory=dict)  # backend stubs seen when the server got ready
    expected_stubs: frozenset[str] = frozenset()  # stub names of the first ready start: a restart must match
    cpu_cores: set[int] | None = None  # where the server runs (the decode cores left out); None: anywhere
    binding: str = ""  # the repository's decode_cores on this machine, in words ("" when it asks for none)
    _log_file: object = field(default=None, repr=False)
    _watchdog: threading.Thread | None = field(default=None, repr=False)
    _stopping: threading.Event = field(default_factory=threading.Event, repr=False)
    _watched: threading.Event | None = field(default=None, repr=False)  # the event the watchdog thread waits on
    front: BodyLimitFront | None = None  # the public HTTP port's body-limit front (kept across restarts)

    def start(self, *, append_log: bool = False) -> "TritonServer":
        self.failure, self.stubs = None, {}
        self._stopping = threading.Event()
        self._log_file = open(self.log_path, "ab" if append_log else "wb")
        # The parent-death signal fires when the *thread* that forked the server ends: only a server
        # started from the main thread gets it (one restarted from a worker thread would otherwise be
        # stopped as soon as that thread returns).
        main = threading.current_thread() is threading.main_thread()
        self.process = subprocess.Popen(self.command, env=self.env, stdout=self._log_file, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL,
                                        preexec_fn=_on_cores(_preexec if main else _new_group, self.cpu_cores),
                                        cwd=str(self.workspace))
        return self

    @property
    def shm_prefix(self) -> str:
        return _shm_prefix(self.command)

    # -- supervision ---------------------------------------------------------------------------
    def check(self) -> str | None:
        """What is wrong with the running server, or None: it exited, or a backend stub that was
        there when it got ready has died."""
        if self.process is None:
            return "not started"
        exited = self.process.poll() is not None
        dead = [f"{name} (pid {pid})" for pid, name in self.stubs.items() if _proc_state(pid) in (None, "Z", "X")]
        dead += [f"{name} (gone before it was watched)" for name in self.expected_stubs - set(self.stubs.values())]
        # Triton 2.51 sometimes aborts itself when a stub dies mid-request: say both, the stub first.
        problems = ["Python backend stub process died: " + ", ".join(sorted(dead))] if dead else []
        if exited:
            problems.append(f"tritonserver exited with code {self.process.returncode}")
        return "; ".join(problems) or None

    def _watch(self, stopping: threading.Event) -> None:
        # ``stopping`` is this start's event: a restart replaces ``self._stopping`` with a new one.
        while not stopping.wait(self.watch_period_s):
            problem = self.check()
            if problem is None:
                continue
            if stopping.is_set():
                return
            self.failure = problem
            if self.process is not None:
                # Every model of the repository depends on the dead one and Triton 2.51 neither restarts
                # nor reports it: end the group now, so in-flight requests fail instead of hanging. When
                # the server aborted itself first, its other stubs are still in the group: end them too.
                self._kill_group()
            self._remove_shm()
            return

    def join_watchdog(self, timeout: float | None = None) -> None:
        """Wait until the watchdog has finished (after a failure: the group is gone, regions removed)."""
        if self._watchdog is not None:
            self._watchdog.join(timeout)

    def start_watchdog(self) -> None:
        """Record the backend stubs and start watching them (done by ``wait_ready``)."""
        if self.process is None:
            return
        self.stubs = backend_stubs(self.process.pid)
        if not self.expected_stubs:
            self.expected_stubs = frozenset(self.stubs.values())
        old = self._watchdog
        if old is None or not old.is_alive() or self._watched is not self._stopping:  # an old one is on its way out
            self._watched = self._stopping
            self._watchdog = threading.Thread(target=self._watch, args=(self._stopping,),
                                              name="tritonserver-watchdog", daemon=True)
            self._watchdog.start()

    def _kill_group(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            pass
        # Stubs are reparented when the server dies first: wait until none of the group is left.
        deadline = time.monotonic() + 10
        while backend_stubs(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _remove_shm(self) -> list[str]:
        """Remove this server's shared-memory regions (left behind when the server was killed)."""
        removed = []
        for path in shm_regions(self.shm_prefix):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
        return removed

    def restart(self, timeout_s: float = 300.0, abort: Callable[[], bool] | None = None) -> "TritonServer":
        """Start the same server again (same ports, repository and workspace) and wait until ready
        (or until ``abort()`` is true: see ``wait_ready``)."""
        self._stopping.set()
        self.join_watchdog(60)  # a watchdog still ending the old group must not outlive into the new one
        if self.process is not None and self.process.poll() is None:
            self._kill_group()
        self._remove_shm()
        if self._log_file is not None:
            self._log_file.close()
        self.start(append_log=True)
        return self.wait_ready(timeout_s, abort)

    def log_tail(self, lines: int = 40) -> str:
        """The server log's error lines (E...) and its last lines, without Triton's wide status tables."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        rows = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(("|", "+"))]
        errors = [ln for ln in rows if ln[:1] == "E" or "Error" in ln or "error:" in ln][-lines // 2:]
        tail = rows[-(lines - len(errors)):]
        return "\n".join(dict.fromkeys(errors + tail))

    def _get(self, path: str, timeout: float = 2.0) -> int:
        try:
            with urllib.request.urlopen(self.endpoints.http + path, timeout=timeout) as r:  # noqa: S310
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (urllib.error.URLError, OSError):
            return 0

    def is_ready(self) -> bool:
        return self._get("/v2/health/ready") == 200

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def model_states(self) -> dict[str, str]:
        """{model: state (READY, UNAVAILABLE, ...) + reason} from the repository index."""
        import json

        req = urllib.request.Request(self.endpoints.http + "/v2/repository/index", data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=5) as r:  # noqa: S310
                rows = json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError):
            return {}
        return {r["name"]: (r.get("state", "?") + (f": {r['reason']}" if r.get("reason") else "")) for r in rows}

    def wait_ready(self, timeout_s: float = 300.0, abort: Callable[[], bool] | None = None) -> "TritonServer":
        """Block until ``/v2/health/ready`` answers 200; on exit or timeout raise with the log tail.
        Returns early, not ready and unwatched, once ``abort()`` is true (the caller was asked to stop
        and stops the server)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if abort is not None and abort():
                return self
            if not self.is_alive():
                code = self.process.returncode if self.process else None
                tail = self.log_tail()
                self.stop(keep_log=True)
                raise BackendUnavailable(f"tritonserver exited with code {code} before it was ready; "
                                         f"log tail ({self.log_path}):\n{tail}")
            if self.is_ready():
                self.start_watchdog()
                return self
            # With strict readiness a failed model keeps the server unready forever: report it now.
            if self._get("/v2/health/live") == 200:
                failed = {m: s for m, s in self.model_states().items() if s.startswith("UNAVAILABLE")}
                if failed:
                    detail = "; ".join(f"{m}: {s}" for m, s in failed.items())
                    tail = self.log_tail()
                    self.stop(keep_log=True)
                    raise BackendUnavailable(f"models failed to load: {detail}\nlog tail ({self.log_path}):\n{tail}")
            time.sleep(0.25)
        states, tail = self.model_states(), self.log_tail()
        self.stop(keep_log=True)
        raise BackendUnavailable(f"tritonserver not ready after {timeout_s:.0f} s (models: {states or 'unknown'}); "
                                 f"log tail ({self.log_path}):\n{tail}")

    def stop(self, grace_s: float = 15.0, *, keep_log: bool = False) -> int | None:
        """SIGINT to the server (graceful), then SIGKILL to its whole process group after ``grace_s``
        (seconds); returns the server's exit code. The private
        workspace is removed, except the server log when ``keep_log`` (failures point to it)."""
        rc = None
        self._stopping.set()
        if self.front is not None:
            self.front.stop()
        if self.process is not None:
            if self.process.poll() is None:
                # The server alone: it finalizes its models and stops their stubs itself (a stub
                # interrupted directly dies mid-request and the server exits with an error).
                self.process.send_signal(signal.SIGINT)
                try:
                    rc = self.process.wait(grace_s)
                except subprocess.TimeoutExpired:
                    pass
            # Stubs and MPI ranks share the server's group; make sure none is left behind.
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                rc = self.process.wait(5)
            except subprocess.TimeoutExpired:
                pass
            deadline = time.monotonic() + 5
            while backend_stubs(self.process.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            self._remove_shm()  # a server that had to be killed cannot remove its own regions
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if not self.keep_workspace:
            log_inside = self.workspace in self.log_path.parents
            if keep_log and log_inside:
                shutil.rmtree(self.workspace / "backends", ignore_errors=True)
            else:
                shutil.rmtree(self.workspace, ignore_errors=True)
        return rc

    def __enter__(self) -> "TritonServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


WORKSPACE_PREFIX = "trtmoe-triton-"
# Request bodies refused (413) before tritonserver parses them: far above any prompt an engine takes
# (a 128k-token prompt is about 0.5 MB of text), below the 4 MB an upstream report has end
# tritonserver 2.51 (not reproduced here: bodies of 4-64 MB were answered; 4 MB of prompt or bad_words
# held the server 24-39 s).
DEFAULT_MAX_HTTP_BODY = 3 * 2**20
KEPT_LOG_DAYS = 7


def remove_stale_workspaces(root: str | Path | None = None, *, keep_log_days: float = KEPT_LOG_DAYS) -> list[Path]:
    """Remove the private workspaces (``trtmoe-triton-PID-*`` in the temp directory) of servers whose
    launcher is gone: killed runs leave the copied backends behind. A workspace holding only the
    log of a failed start (whose path that run printed) is kept for ``keep_log_days`` days.
    Returns the removed directories."""
    removed = []
    for d in sorted(Path(root or tempfile.gettempdir()).glob(WORKSPACE_PREFIX + "*")):
        pid = d.name[len(WORKSPACE_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or not own_directory(d) or pid_alive(int(pid)):
            continue
        try:
            only_log = [c.name for c in d.iterdir()] == ["tritonserver.log"]
            age_days = (time.time() - d.stat().st_mtime) / 86400
        except OSError:
            continue
        if only_log and age_days < keep_log_days:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def serve_repository(repo: str | Path, *, host: str = "127.0.0.1", http_port: int = 8000, grpc_port: int = 8001,
                     metrics_port: int = 8002, world_size: int | None = None, server: str | None = None,
                     timeout_s: float = 300.0, log_file: str | Path | None = None, log_verbose: int = 0,
                     extra_args: Sequence[str] = (), wait: bool = True,
                     max_http_body_bytes: int = DEFAULT_MAX_HTTP_BODY) -> TritonServer:
    """Start tritonserver on ``repo`` and (``wait``) block until it is ready, up to ``timeout_s`` seconds.

    Port 0 picks a free port. ``world_size`` defaults to the repository manifest's launch world size
    (1 for embedded engines, tp x pp for TensorRT engines). ``server`` picks the installation
    ("system" / "pytriton"; default: system first). Returns a started TritonServer; ``stop()`` it,
    or use it as a context manager. Raises BackendUnavailable with the server log tail on failure.
    ``max_http_body_bytes`` > 0 puts the HTTP port behind ``front.BodyLimitFront``: request bodies
    over it are answered 413 before tritonserver reads them (0: tritonserver listens itself).
    """
    repo = Path(repo).expanduser().absolute()
    if not repo.is_dir() or not any(repo.glob("*/config.pbtxt")):
        raise InputError("not a Triton model repository (no */config.pbtxt)", where=str(repo),
                         hint="create one with `trtmoe repo ENGINE_DIR -o REPO`")
    manifest = read_repository_manifest(repo)
    ws = world_size or int(manifest.get("launch_world_size", 1) or 1)
    install = find_tritonserver(server)
    if ws > 1 and install.kind == PYTRITON:
        raise BackendUnavailable(f"world_size {ws} needs the NGC TensorRT-LLM container (MPI + tensorrtllm backend)")
    backend = (manifest.get("engine") or {}).get("backend")
    if backend == "tensorrtllm" and install.kind == PYTRITON:
        raise BackendUnavailable("this repository serves a TensorRT engine, which needs the tensorrtllm backend of "
                                 "the NGC tritonserver:<yy.mm>-trtllm-python-py3 container",
                                 hint="inside it, run `trtmoe serve` again (it uses the container's tritonserver)")
    asked = (("http", http_port), ("grpc", grpc_port), ("metrics", metrics_port))
    fixed = [port for _, port in asked if port]
    for name, port in asked:
        if port and fixed.count(port) > 1:
            raise InputError(f"port {port} is given for more than one endpoint", hint="give each endpoint its own port or 0")
        if port and _port_in_use(host, port):
            raise InputError(f"{name} port {port} on {host} is already in use", hint=f"pass --{name}-port or 0 for a free one")
    chosen = iter(free_ports(sum(1 for _, port in asked if not port) + (1 if max_http_body_bytes else 0), host,
                             avoid=fixed))
    ports = [port or next(chosen) for _, port in asked]
    endpoints = Endpoints(host, *ports)
    # Behind the front, tritonserver's HTTP listens on 127.0.0.1 only, on a port of its own.
    inner = Endpoints(host, next(chosen), ports[1], ports[2]) if max_http_body_bytes else endpoints
    remove_stale_workspaces()
    workspace = Path(tempfile.mkdtemp(prefix=f"{WORKSPACE_PREFIX}{os.getpid()}-"))
    try:
        backend_dir = prepare_backends(install, workspace)
        env = server_environment(install)
    except BaseException:
        shutil.rmtree(workspace, ignore_errors=True)
        raise
    cmd = build_launch_command(repo, install, endpoints=inner, world_size=ws, backend_dir=backend_dir,
                               shm_prefix=f"trtmoe{os.getpid()}{uuid.uuid4().hex[:6]}r", log_verbose=log_verbose,
                               extra_args=extra_args, http_host="127.0.0.1" if max_http_body_bytes else None)
    log_path = Path(log_file).absolute() if log_file else workspace / "tritonserver.log"
    binding = decode_binding(repo, manifest)
    rest, said = None, ""
    if isinstance(binding, tuple):  # the model moves its decode thread to these; the server starts on the rest
        env[cpu_binding.ENV] = cpu_binding.format_cores(binding[0])
        rest = binding[1]
        said = (f"decode thread on cores {env[cpu_binding.ENV]}, tritonserver and its other threads on "
                f"{cpu_binding.format_cores(rest)}")
    elif binding is not None:
        said = f"decode_cores not applied: {binding}"
    front = None
    if max_http_body_bytes:
        try:
            front = BodyLimitFront(host, endpoints.http_port, inner.http_port, max_http_body_bytes).start()
        except OSError as e:
            shutil.rmtree(workspace, ignore_errors=True)
            raise InputError(f"http port {endpoints.http_port} on {host} cannot be opened ({e.strerror})",
                             hint="pass --http-port or 0 for a free one") from None
    srv = TritonServer(repo=repo, endpoints=endpoints, install=install, command=cmd, env=env, log_path=log_path,
                       workspace=workspace, cpu_cores=rest, binding=said, front=front)
    try:
        srv.start()
    except BaseException:
        if front is not None:
            front.stop()
        raise
    if wait:
        try:
            srv.wait_ready(timeout_s)
        except BackendUnavailable:
            raise  # already stopped, log kept
        except BaseException:
            srv.stop()
            raise
    return srv


class RestartBudget:
    """How many restarts ``run_until_signalled`` may still make: at most ``limit`` within any
    ``window_s`` seconds (0: within the whole run). ``clock`` gives seconds (monotonic)."""

    def __init__(self, limit: int, window_s: float = 0.0, clock=time.monotonic):
        if limit < 0 or window_s < 0:
            raise ValueError(f"limit and window_s must be >= 0, got {limit}, {window_s}")
        self.limit, self.window_s, self.clock = int(limit), float(window_s), clock
        self.times: list[float] = []  # when each restart that still counts was made
        self.total = 0  # restarts over the whole run

    def recent(self) -> int:
        """Restarts made within the last window (all of them when the window is 0)."""
        if self.window_s > 0:
            since = self.clock() - self.window_s
            self.times = [t for t in self.times if t > since]
        return len(self.times)

    def allows(self) -> bool:
        return self.recent() < self.limit

    def record(self) -> int:
        """Count a restart made now; returns the restarts within the window, this one included."""
        self.recent()
        self.times.append(self.clock())
        self.total += 1
        return len(self.times)

    @property
    def window_text(self) -> str:
        return f"in the last {self.window_s:g} s" if self.window_s > 0 else "in this run"

    def describe(self) -> str:
        """Why no restart is left, e.g. "restarted 3 time(s) in the last 3600 s (limit 3)"."""
        n = self.recent()
        more = f", {self.total} in all" if self.total != n else ""
        return f"restarted {n} time(s) {self.window_text} (limit {self.limit}{more})"


def run_until_signalled(srv: TritonServer, on_ready=None, *, restarts: int = 0, restart_window_s: float = 0.0,
                        timeout_s: float = 300.0, on_restart=None, on_restarted=None, clock=time.monotonic,
                        backoff_max_s: float = 0.0, on_backoff=None) -> int:
    """Foreground loop for the CLI: return on SIGINT/SIGTERM (then stop the server).

    When the server exits or a backend stub dies (the watchdog has then ended the group and removed
    its shared memory), it is started again on the same repository and ports, at most ``restarts``
    times within any ``restart_window_s`` seconds (0: within the whole run; ``clock`` measures it), so
    a server that dies now and then is restarted every time and one that keeps dying is given up on.
    ``on_restart(srv, reason, n)`` is called before each restart, ``n`` the restarts within the
    window, this one included (the CLI prints one line), and ``on_restarted(srv, n)`` once it is
    ready again and watched. When no restart is left it raises TrtmoeError (exit 1), unless
    ``backoff_max_s`` > 0: then it waits 1, 2, 4 ... seconds (at most ``backoff_max_s``; doubling while
    the budget stays spent, back to 1 once it is not) and restarts anyway, calling
    ``on_backoff(srv, reason, why, wait_s)`` first, so that a request which crashes the server can cost
    the service a bounded wait but never end it (with ``restarts`` 0 the first failure still ends the
    loop). A restart that fails to get ready raises (BackendUnavailable).
    """
    stop = {"sig": None}

    def handler(signum, frame):
        stop["sig"] = signum

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    budget = RestartBudget(restarts, restart_window_s, clock)
    over = 0  # restarts in a row made past the budget (each one waits twice as long)
    try:
        if on_ready:
            on_ready(srv)
        while True:
            while stop["sig"] is None and srv.is_alive() and srv.failure is None:
                time.sleep(0.2)
            if stop["sig"] is not None:
                break
            srv.join_watchdog(30)  # a dead stub: the group is being ended and its regions removed
            reason = srv.failure or srv.check() or "tritonserver stopped"
            if not budget.allows() and backoff_max_s > 0 and restarts > 0:
                wait_s = min(float(backoff_max_s), 2.0 ** over)
                over += 1
                if on_backoff:
                    on_backoff(srv, reason, budget.describe(), wait_s)
                until = time.monotonic() + wait_s
                while stop["sig"] is None and time.monotonic() < until:
                    time.sleep(min(0.1, max(until - time.monotonic(), 0.0)))
                if stop["sig"] is not None:
                    break
            elif not budget.allows():
                what = f"{budget.describe()}; " if budget.total else ""
                raise TrtmoeError(f"{reason}; {what}tritonserver was stopped so that clients get an error instead "
                                  f"of a hang; log tail:\n{srv.log_tail()}",
                                  hint="`trtmoe serve --restart N --restart-window SECONDS` restarts it up to N "
                                       "times within any SECONDS; a non-zero exit lets a supervisor take over")
            else:
                over = 0
            n = budget.record()
            if on_restart:
                on_restart(srv, reason, n)
            # Raises BackendUnavailable (log tail included) if it does not get ready; a signal during
            # the restart ends the wait, and the loop, at once.
            srv.restart(timeout_s, abort=lambda: stop["sig"] is not None)
            if stop["sig"] is not None:
                break
            if on_restarted:
                on_restarted(srv, n)
        return 0
    finally:
        srv.stop()
        for s, h in old.items():
            signal.signal(s, h)
