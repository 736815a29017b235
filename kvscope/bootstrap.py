"""The child side of `kvscope run`: set the probes up, run the target as `__main__`.

`python -m kvscope.bootstrap script.py [args]` or `python -m kvscope.bootstrap -m module [args]`,
with `KVSCOPE_RUN_DIR` naming the supervisor's run directory; `launch()` starts it, and is all
the parent imports of this module (the hooks are imported by `main`, in the child). The hooks (kvscope/child.py) record
the pools every process of the run opens; the bootstrap adds `exception`: the uncaught exception
that ended the script, as JSON.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import IO, TYPE_CHECKING, Any

# What only the child needs (running the target, recording how it ended) is imported there:
# every module the parent imports before `launch` delays the script's first line.
if TYPE_CHECKING:
    from kvscope.stopper import Stopper


# The signal at which the script writes every thread's Python stack into the run directory's
# `stacks` file (faulthandler, which writes from the signal handler without the GIL, so a script
# whose threads deadlocked holding it still answers): what the supervisor shows of a script that
# outlived its stop signal's grace period, before it kills it. A real-time signal: no program
# gives it a meaning of its own (SIGUSR1 and SIGUSR2 often have one: reopen logs, reload).
STACKS_SIGNAL = signal.SIGRTMIN + 6
STACKS_FILE = "stacks"
_stacks_file: IO[str] | None = None  # (the child's: faulthandler writes into its descriptor)


def launch(
    target: list[str], env: dict[str, str], stopper: Stopper, **popen_kw: Any
) -> subprocess.Popen[bytes]:
    """Start `python -m kvscope.bootstrap <target>` with `env`, stopped and signalled by
    `stopper` (popen_kw: its pipes); the child."""
    cmd = [sys.executable, "-m", "kvscope.bootstrap", *target]
    proc = subprocess.Popen(cmd, env=env, preexec_fn=stopper.child_setup(), **popen_kw)
    stopper.watch(proc)
    return proc


def thread_stacks(pid: int, run_dir: str, wait_s: float = 1.0) -> str:
    """The script's threads' Python stacks, as faulthandler writes them at STACKS_SIGNAL ("" if
    none came within `wait_s`: a script that is not ours, or one stopped in the kernel)."""
    path = os.path.join(run_dir, STACKS_FILE)
    try:
        os.kill(pid, STACKS_SIGNAL)
    except ProcessLookupError:
        return ""
    deadline = time.monotonic() + wait_s
    size = -1
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            now = os.path.getsize(path)
        except OSError:
            continue
        if now > 0 and now == size:
            break  # (written, and no longer growing)
        size = now
    try:
        with open(path, errors="replace") as f:
            return _program_threads(f.read())
    except OSError:
        return ""


def stacks_said(pid: int, run_dir: str, lead: str) -> str:
    """`kvscope: LEAD; its threads now ...` and the script's threads' stacks (thread_stacks),
    as kvscope says them; "" when none came."""
    text = thread_stacks(pid, run_dir)
    if not text:
        return ""
    return (
        f"kvscope: {lead}; its threads now (most recent call first; threads waiting on locks"
        " that the others hold are deadlocked):\n" + text
    )


def _program_threads(text: str) -> str:
    """faulthandler's stacks of the program's threads: each thread with a frame of the
    program's own (kvscope's threads in the script, the probes' watchdog, go), its frames
    without kvscope's and runpy's (the bootstrap that ran the script)."""
    ours = tuple(_package_dirs())
    plumbing = ("in _bootstrap", "in _bootstrap_inner", "in run")  # (threading.py's)
    kept: list[str] = []
    for block in text.strip().split("\n\n"):
        lines = block.splitlines()
        frames = [
            ln
            for ln in lines[1:]
            if not any(d in ln for d in ours)
            and "runpy" not in ln
            and not ("/threading.py" in ln and ln.endswith(plumbing))
        ]
        if any("/threading.py" not in ln for ln in frames):
            kept.append("\n".join([lines[0], *frames]))
    return "\n\n".join(kept)


def _package_dirs() -> list[str]:
    """The directories of kvscope's packages (kvscope.probes and the others live beside
    kvscope/ in a source tree, not under it), each with a trailing separator."""
    import importlib.util

    dirs = [os.path.dirname(os.path.abspath(__file__))]
    for sub in ("allocator", "kernels", "probes", "tui"):
        spec = importlib.util.find_spec(f"kvscope.{sub}")
        dirs += list(spec.submodule_search_locations or []) if spec else []
    return [os.path.abspath(d) + os.sep for d in dirs]


def _answer_stacks() -> None:
    """In the child: faulthandler writes every thread's stack into the run directory at
    STACKS_SIGNAL (the file kept open: faulthandler holds its descriptor)."""
    import faulthandler

    from kvscope.child import run_dir

    global _stacks_file
    out = run_dir()
    if out is None:
        return
    _stacks_file = open(os.path.join(out, STACKS_FILE), "w")
    faulthandler.register(STACKS_SIGNAL, file=_stacks_file, all_threads=True)


def _record_exception(e: BaseException) -> None:
    """Write the exception that ended the script to the run directory, for the dump's reason."""
    import json
    import traceback

    from kvscope.child import run_dir

    out = run_dir()
    if out is None:
        return
    frames = traceback.extract_tb(e.__traceback__)
    last = frames[-1] if frames else None
    where = f"{last.filename}:{last.lineno} in {last.name}" if last else ""
    with open(os.path.join(out, "exception"), "w") as f:
        json.dump({"type": type(e).__name__, "message": str(e)[:500], "where": where}, f)


def main(argv: list[str]) -> int:
    """Run `script.py args` or `-m module args` as __main__ with the hooks installed."""
    import importlib.util
    import runpy

    if not argv or (argv[0] == "-m" and len(argv) < 2):
        print("kvscope: error: bootstrap needs a script or -m module", file=sys.stderr)
        return 2
    if argv[0] == "-m":
        module, args = argv[1], argv[2:]
        if importlib.util.find_spec(module) is None:
            print(f"kvscope: error: no module named {module!r}", file=sys.stderr)
            return 2
        sys.argv = [module, *args]
    else:
        script, args = argv[0], argv[1:]
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
    # Here, not at the top: the parent imports this module for `launch` alone.
    from kvscope.child import install

    install()
    _answer_stacks()
    try:
        if argv[0] == "-m":
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit:
        raise
    except BaseException as e:
        _record_exception(e)
        _print_user_traceback(e)
        return 1
    return 0


def _print_user_traceback(e: BaseException) -> None:
    """The traceback as `python script.py` would print it: without the bootstrap's frames."""
    import runpy

    tb = e.__traceback__
    while tb is not None and (
        tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
        or tb.tb_frame.f_code.co_filename.startswith("<frozen")
    ):
        tb = tb.tb_next
    sys.excepthook(type(e), e.with_traceback(tb), tb)


if __name__ == "__main__":
    # Re-import under the real name so `main` lives in `kvscope.bootstrap`, not in a
    # `__main__` that runpy replaces with the target's.
    from kvscope.bootstrap import main as _main

    sys.exit(_main(sys.argv[1:]))
