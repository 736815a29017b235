"""The one user-facing error type of serve.py: a message and the exit code it maps to."""

from __future__ import annotations


class ServeError(Exception):
    """Something the user can fix (a bad path, a bad file, a bad flag); printed as one line."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code
