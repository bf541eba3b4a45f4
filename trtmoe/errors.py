"""One small error hierarchy. The CLI maps each class to an exit code and prints one line."""

from __future__ import annotations


class TrtmoeError(Exception):
    """A failure the user can act on. Exit code 1."""

    exit_code = 1

    def __init__(self, what: str, *, where: str | None = None, hint: str | None = None):
        self.what = what
        self.where = where
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        msg = self.what
        if self.where:
            msg = f"{self.where}: {msg}"
        if self.hint:
            msg = f"{msg} ({self.hint})"
        return msg


class InputError(TrtmoeError):
    """Bad input or usage: unreadable checkpoint, invalid config, impossible layout. Exit code 2."""

    exit_code = 2


class CheckpointError(InputError):
    """A source checkpoint is malformed (truncated file, lying header, missing shard, bad tensor)."""


class UnsupportedError(InputError):
    """Something valid but not supported (architecture, format, target)."""


class LayoutError(InputError):
    """A parallel layout that cannot be realised (divisibility, world size)."""


class NotBuildable(UnsupportedError):
    """A well-formed layout and format that the target's support table refuses (``inspect --target``).
    Exit code 3, apart from bad input, so that a planning script can gate on it."""

    exit_code = 3


class ConfigError(InputError):
    """An invalid YAML build config or option value."""


class VerifyError(TrtmoeError):
    """An artifact does not match its manifest. Exit code 1."""


class BackendUnavailable(TrtmoeError):
    """A build/serve backend is not installed or has no device here. Exit code 1."""


def raised_in(e: BaseException, package: str) -> str | None:
    """Where ``e`` was raised, as ``path:line in function`` relative to ``package``'s folder, when the
    innermost frame of its traceback that lies in trtmoe or in ``package`` (an imported top-level
    package: transformers, torch…) lies in ``package``; None otherwise (trtmoe's own frame is innermost,
    or ``package`` is not imported)."""
    import sys
    from pathlib import Path

    mod = sys.modules.get(package)
    if mod is None or not getattr(mod, "__file__", None):
        return None
    theirs, ours = Path(mod.__file__).resolve().parent, Path(__file__).resolve().parent
    tb, last = e.__traceback__, None
    while tb is not None:
        f = Path(tb.tb_frame.f_code.co_filename).resolve()
        if f.is_relative_to(theirs):
            last = f"{f.relative_to(theirs.parent)}:{tb.tb_lineno} in {tb.tb_frame.f_code.co_name}"
        elif f.is_relative_to(ours):
            last = None
        tb = tb.tb_next
    return last
