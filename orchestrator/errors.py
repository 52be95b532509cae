"""Error types that carry the exit code the CLI returns.

Exit codes (docs/architecture.md, "Exit codes"): 0 ok, 1 a host or stage failed, 2 bad input.
"""
from __future__ import annotations


class DeployctlError(Exception):
    exit_code = 1


class InputError(DeployctlError):
    """Bad input: a file, key or value the user must fix. Exit code 2.

    The message names the file, the key path and what was expected, so the
    user can fix it without reading code.
    """

    exit_code = 2

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None,
                 line: int | None = None):
        self.detail, self.file, self.key, self.line = message, file, key, line
        where = ""
        if file:
            where = str(file) + (f":{line}" if line else "")
        if key:
            where = f"{where}: {key}" if where else key
        super().__init__(f"{where}: {message}" if where else message)


class NotImplementedStage(DeployctlError):
    """A command whose stage has not been built yet: says so, exit 2, never a fake success."""

    exit_code = 2


class StageFailed(DeployctlError):
    """One or more hosts failed a stage. Exit code 1; the message names them."""

    exit_code = 1
