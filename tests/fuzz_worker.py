"""The worker behind tests/test_fuzz_hostile.py: run verb lines through kvscope.cli.main, each
under an interval timer, the whole process under RLIMIT_AS, and write what each one did.

`python -m tests.fuzz_worker spec.json`; spec: {"runs": [{"argv": [...]}, ...], "out": path,
"time_bound_s": s, "memory_bound_bytes": n}.
"""

from __future__ import annotations

import contextlib
import io
import json
import resource
import signal
import sys
import time
import traceback


class Overtime(Exception):
    """One run passed the time bound."""


def _on_alarm(signum, frame):  # type: ignore[no-untyped-def]
    raise Overtime


def _mapped_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize in /proc/self/status")


def main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    from kvscope.cli import main as kvscope_main

    # Everything kvscope needs is imported: from here on, the address space may grow only by
    # the bound, so an unbounded allocation is a MemoryError, reported as a crash.
    limit = _mapped_bytes() + int(spec["memory_bound_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    signal.signal(signal.SIGALRM, _on_alarm)
    results = []
    for run in spec["runs"]:
        out, err = io.StringIO(), io.StringIO()
        crash = None
        code = None
        t0 = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, float(spec["time_bound_s"]))
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = kvscope_main(list(run["argv"]))
        except BaseException:  # noqa: BLE001 - anything escaping main is what we look for
            crash = traceback.format_exc()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        results.append(
            {
                **run,
                "code": code,
                "stderr": err.getvalue(),
                "crash": crash,
                "elapsed_s": time.perf_counter() - t0,
            }
        )
    with open(spec["out"], "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
