"""Runs ``trtmoe`` command lines in forked copies of one process that has already imported the CLI,
so that each case is a real process (its own exit status, stderr, limits and simulated kernel
errors) without paying the interpreter and torch start-up every time.

Protocol: one JSON object per stdin line, ``{"args": [...], "stderr": PATH, "fault": SPEC|null,
"fsize": BYTES|null, "tmpdir": DIR}``; one line back per case, ``{"rc": EXIT_STATUS}``. ``fault``
is the ``TRTMOE_TEST_OS_FAULT`` spec of ``sitecustomize.py`` beside this file; ``fsize`` sets
RLIMIT_FSIZE (``ulimit -f``) in the case's process. The zygote itself never runs a command, so no
thread of it exists when it forks.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(1)
from trtmoe.cli import main  # noqa: E402

_FAULTS = Path(__file__).with_name("sitecustomize.py")


def _case(req: dict, err: int) -> None:
    """The forked child: set up the case's process, run the command, exit with its status. Its
    stderr is a pipe (a file would be subject to the case's RLIMIT_FSIZE too)."""
    os.dup2(err, 2)
    os.close(err)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.environ["TMPDIR"] = req["tmpdir"]
    code = 0
    try:
        if req.get("fsize") is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (req["fsize"], req["fsize"]))
        if req.get("fault"):
            os.environ["TRTMOE_TEST_OS_FAULT"] = json.dumps(req["fault"])
            exec(compile(_FAULTS.read_text(), str(_FAULTS), "exec"), {"__name__": "sitecustomize"})
        main(req["args"], prog_name="trtmoe", standalone_mode=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - what an uncaught exception does to a real process
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _case(req, w)
        os.close(w)
        with open(r, "rb") as pipe, open(req["stderr"], "wb") as f:
            f.write(pipe.read())
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
