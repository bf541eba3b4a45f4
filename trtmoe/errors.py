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
