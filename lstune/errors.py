"""Errors that reach the user as a message, not a traceback.

Every layer raises `UserError` (or a subclass) for mistakes the user can fix; the CLI prints
the message and exits with code 2. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input. The message names the problem and the fix."""

    exit_code = 2
    quiet = False  # True: the CLI exits with the code without printing (the message was printed elsewhere)

    def __init__(self, message: str, *, problems: list[str] | None = None):
        self.problems = problems or [message]
        super().__init__(message)


class ConfigError(UserError):
    """One or more invalid config values; `problems` lists each of them."""

    def __init__(self, problems: list[str]):
        lines = problems if len(problems) == 1 else [f"{len(problems)} problems in the config:"] + [
            f"  - {p}" for p in problems
        ]
        super().__init__("\n".join(lines), problems=problems)


class DataError(UserError):
    """The training data is missing, empty or has no usable fields."""


class ModelError(UserError):
    """The model cannot be found or loaded."""


class CheckpointError(UserError):
    """A checkpoint is missing, partial or corrupt."""


class PeerFailed(UserError):
    """Another process of a distributed run failed with a message of its own (the main process's, shown once);
    this one only stops, with the same exit code and without repeating it."""

    quiet = True
