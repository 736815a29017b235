"""The script panel of `kvscope run --live`: the script's output and whether it has ended."""

from __future__ import annotations

from typing import Protocol

from kvscope.tui.widgets import retitle
from kvscope.tui.widgets.rows import Row, RowsView


class ScriptOutput(Protocol):
    """What the panel reads (kvscope.scriptlog.ScriptLog)."""

    version: int

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def status(self) -> str:
        """`running`, `exited with status N`, `killed by SIGNAME`."""
        ...

    def tail(self) -> list[tuple[str, str]]:
        """(stream, line) pairs, oldest first."""
        ...


class ScriptPanel(RowsView):
    """The script's stdout and stderr (stderr in yellow), oldest first; the cursor follows the
    newest line while it is on the last row. The title says whether the script still runs."""

    COLUMNS = [("", 1), ("script output", 0)]

    def __init__(self, script: ScriptOutput, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.script = script
        self.empty_text = "no output yet"
        self._version = -1
        self._status = ""
        self.lines: list[tuple[str, str]] = []
        self.border_title = f"script pid {script.pid}"

    def refresh_output(self) -> None:
        """Show new output and the script's state (cheap when neither changed)."""
        status = self.script.status()
        if status != self._status:
            self._status = status
            retitle(self, f"script pid {self.script.pid}: {status}")
        version = self.script.version
        if version == self._version:
            return
        self._version = version
        follow = self.num_rows == 0 or self.cursor >= self.num_rows - 1
        self.lines = self.script.tail()
        lines = self.lines

        def row_of(i: int) -> Row:
            stream, text = lines[i]
            err = stream == "stderr"
            return (("!" if err else " ", text), "yellow" if err else None)

        self.set_rows(len(lines), row_of)
        if follow and lines:
            self.cursor = len(lines) - 1
