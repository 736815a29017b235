"""The child side of `kvscope run`: set the probes up, run the target as `__main__`.

`python -m kvscope.bootstrap script.py [args]` or `python -m kvscope.bootstrap -m module [args]`,
with `KVSCOPE_RUN_DIR` naming the supervisor's run directory; `launch()` starts it, and is all
the parent imports of this module (the hooks are imported by `main`, in the child). The hooks (kvscope/child.py) record
the pools every process of the run opens; the bootstrap adds `exception`: the uncaught exception
that ended the script, as JSON.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

# What only the child needs (running the target, recording how it ended) is imported there:
# every module the parent imports before `launch` delays the script's first line.
if TYPE_CHECKING:
    from kvscope.stopper import Stopper


def launch(
    target: list[str], env: dict[str, str], stopper: Stopper, **popen_kw: Any
) -> subprocess.Popen[bytes]:
    """Start `python -m kvscope.bootstrap <target>` with `env`, stopped and signalled by
    `stopper` (popen_kw: its pipes); the child."""
    cmd = [sys.executable, "-m", "kvscope.bootstrap", *target]
    proc = subprocess.Popen(cmd, env=env, preexec_fn=stopper.child_setup(), **popen_kw)
    stopper.watch(proc)
    return proc


def _record_exception(e: BaseException) -> None:
    """Write the exception that ended the script to the run directory, for the dump's reason."""
    import json
    import traceback

    from kvscope.child import package_dirs, run_dir

    out = run_dir()
    if out is None:
        return
    frames = traceback.extract_tb(e.__traceback__)
    # (the program's own line that called into kvscope, where the pool raised it)
    ours = tuple(package_dirs())
    mine = [f for f in frames if not os.path.abspath(f.filename).startswith(ours)]
    last = mine[-1] if mine else frames[-1] if frames else None
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
