"""The script's output under `kvscope run --live`: kept while the TUI has the terminal.

The child's stdout and stderr are pipes; a thread per pipe copies what arrives into a file in
the run directory (all of it) and the last MAX_LINES lines into memory, for the TUI's log
panel. When the TUI closes, `release()` prints what was kept (stdout to stdout, stderr to
stderr) and from then on passes the output straight through; `close()` waits for the last of
it once the child has exited.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections import deque
from typing import IO, BinaryIO

MAX_LINES = 5000
CHUNK = 65536
# How long close() waits for the pipes to end after the child exited (a process the script
# started may still hold them open).
CLOSE_WAIT_S = 2.0


def describe_exit(returncode: int | None) -> str:
    """`running`, `exited with status N` or `killed by SIGNAME`."""
    if returncode is None:
        return "running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


class ScriptLog:
    """The output of one child process, kept until `release()` (see the module docstring)."""

    def __init__(self, proc: subprocess.Popen[bytes], run_dir: str, max_lines: int = MAX_LINES):
        assert proc.stdout is not None and proc.stderr is not None
        self.proc = proc
        self.lines: deque[tuple[str, str]] = deque(maxlen=max_lines)
        # Bumped at every change: the TUI redraws only when it moved.
        self.version = 0
        self.num_lines = 0
        self._lock = threading.Lock()
        self._passthrough = False
        self._partial = {"stdout": "", "stderr": ""}
        self._files: dict[str, BinaryIO] = {
            name: open(os.path.join(run_dir, f"script.{name}"), "w+b")
            for name in ("stdout", "stderr")
        }
        self._threads = [
            threading.Thread(target=self._pump, args=(name, pipe), daemon=True)
            for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr))
        ]
        for t in self._threads:
            t.start()

    @property
    def pid(self) -> int:
        """The script's process id."""
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """The script's exit status (negative: the signal that killed it), None while it runs."""
        return self.proc.poll()

    def status(self) -> str:
        """How the script is doing, in a few words."""
        return describe_exit(self.returncode)

    def _write(self, name: str, data: bytes) -> None:
        out = sys.stdout if name == "stdout" else sys.stderr
        raw: IO[bytes] | None = getattr(out, "buffer", None)
        if raw is not None:
            out.flush()
            raw.write(data)
            raw.flush()
        else:
            out.write(data.decode(errors="replace"))
            out.flush()

    def _pump(self, name: str, pipe: BinaryIO) -> None:
        while True:
            chunk = pipe.read1(CHUNK)  # type: ignore[attr-defined]
            if not chunk:
                break
            with self._lock:
                if self._passthrough:
                    self._write(name, chunk)
                    continue
                self._files[name].write(chunk)
                self._add(name, chunk.decode(errors="replace"))
        pipe.close()

    def _add(self, name: str, text: str) -> None:
        """Split into lines; a carriage return rewrites its line (progress bars)."""
        parts = (self._partial[name] + text).split("\n")
        self._partial[name] = parts.pop()
        for line in parts:
            self.lines.append((name, line.rsplit("\r", 1)[-1]))
            self.num_lines += 1
        self.version += 1

    def tail(self) -> list[tuple[str, str]]:
        """The kept lines, oldest first, and the unfinished last line of each stream."""
        with self._lock:
            out = list(self.lines)
            for name, part in self._partial.items():
                if part.rsplit("\r", 1)[-1]:
                    out.append((name, part.rsplit("\r", 1)[-1]))
            return out

    def release(self) -> None:
        """Print everything kept so far, then pass the output straight through."""
        with self._lock:
            if self._passthrough:
                return
            for name, f in self._files.items():
                f.flush()
                f.seek(0)
                while data := f.read(CHUNK):
                    self._write(name, data)
            self._passthrough = True

    def close(self) -> None:
        """After the child exited: release, wait for the rest of the output, close the files."""
        self.release()
        for t in self._threads:
            t.join(CLOSE_WAIT_S)
        for f in self._files.values():
            f.close()
