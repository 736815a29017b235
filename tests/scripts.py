"""Scripts a test runs as programs (the replay's reproduction scripts, a bench script), run as
`python script` runs them without paying torch's import (1-2 s on a 2-core machine) each time.

One server process, started on first use, imports numpy and torch (not kvscope: a script sets
its probes' environment before it imports kvscope, as it would in a fresh interpreter) and
forks a child per script. The child takes the caller's environment, working folder and argv,
sends its stdout and stderr to files, runs the script as `__main__` and leaves as the interpreter's
exit would (threads joined, atexit handlers run, output flushed), so the exit code is the one
`python repro.py` gives: the script's SystemExit, 1 on an uncaught exception, minus the
signal that killed it."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

_SERVER = r"""
import atexit, json, os, signal, sys, threading, traceback, types
import numpy, torch  # the slow imports every script makes, made once
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        for fd, name in ((1, "out"), (2, "err")):
            f = os.open(req[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = [req["script"], *req["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(req["script"]))
        signal.alarm(req["timeout"])
        code = 0
        try:
            # (its module stays __main__, as in `python script`: what the script holds lives
            # on through the atexit handlers, as it does until an interpreter's teardown)
            main = types.ModuleType("__main__")
            main.__file__ = req["script"]
            sys.modules["__main__"] = main
            with open(req["script"]) as f:
                exec(compile(f.read(), req["script"], "exec"), main.__dict__)
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        # what the interpreter's own exit does before it tears its modules down (torch's
        # teardown alone takes 0.4 s): wait for the threads that are not daemons, run the
        # atexit handlers, flush
        for t in threading.enumerate():
            if t is not threading.main_thread() and not t.daemon:
                t.join()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""

_server: subprocess.Popen[str] | None = None


@dataclass
class Ran:
    """What `python script` gave: its exit code, stdout and stderr."""

    returncode: int
    stdout: str
    stderr: str


def _stop(server: subprocess.Popen[str]) -> None:
    # (waited for, so that its CPU time and its children's count in this process's)
    server.kill()
    server.wait()


def _start() -> subprocess.Popen[str]:
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).parent.parent,
        )
        atexit.register(_stop, _server)
    return _server


def run_script(
    script: str | os.PathLike[str], cwd: str | os.PathLike[str], *args: str, timeout: int = 120
) -> Ran:
    """Run `python script args...` in cwd with this process's environment; its exit code and
    output."""
    server = _start()
    out, err = (Path(cwd) / f".{Path(script).name}.{n}" for n in ("out", "err"))
    req = {
        "script": str(Path(cwd) / script),
        "args": list(args),
        "cwd": str(cwd),
        "out": str(out),
        "err": str(err),
        "env": dict(os.environ),
        "timeout": timeout,
    }
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write(json.dumps(req) + "\n")
    server.stdin.flush()
    line = server.stdout.readline()
    assert line, "the script server died"
    code = int(line)
    ran = Ran(code, out.read_text(), err.read_text())
    out.unlink()
    err.unlink()
    return ran
