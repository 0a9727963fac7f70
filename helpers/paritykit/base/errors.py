"""Errors that reach the user as one line and exit code 2."""

from __future__ import annotations


class ParityKitError(Exception):
    r"""A mistake in the user's input: a missing file, a bad argument, an unreadable checkpoint.

    The CLI prints ``paritykit: error: <message>`` (or a JSON error object with ``--json``) and exits 2.
    The message must name the file or argument at fault and, where it helps, what to do instead.
    """

    exit_code = 2


class UserCodeError(ParityKitError):
    r"""An exception raised inside the user's own code (e.g. a bisect spec).

    ``detail`` holds the traceback trimmed to the user's frames; the CLI prints it after the one-line message.
    """

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


def first_line(exc: BaseException) -> str:
    r"""An exception as one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
