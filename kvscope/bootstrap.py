"""The child side of `kvscope run`: set the probes up, run the target as `__main__`, check at exit.

`python -m kvscope.bootstrap script.py [args]` or `python -m kvscope.bootstrap -m module [args]`,
with `KVSCOPE_RUN_DIR` naming the supervisor's run directory. The bootstrap records there:

- `pools`: one line per pool this process opens (`name<TAB>created_ns<TAB>segment path`), and
  `hdr.<name>.<created_ns>`, the segment header's first bytes, so the supervisor can lay out and
  dump the pool even after a SIGKILL or a scribbled header;
- `unlinks`: pools the script unlinked; the files are renamed aside (the name is free again) and
  the supervisor removes them after it has dumped and analyzed them;
- `exception`: the uncaught exception that ended the script, as JSON;
- `exit.<pid>`: what the leak check at exit found, as JSON.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import json
import os
import runpy
import sys
import traceback
from typing import Any

from kvscope.allocator import pool as pool_module
from kvscope.allocator.findings import Finding
from kvscope.allocator.segment import data_path, segment_path

RUN_DIR_ENV = "KVSCOPE_RUN_DIR"
HEADER_PREFIX_BYTES = 256
# At most this many check findings are written to a pool's findings ring at exit.
MAX_EXIT_FINDINGS = 32

_pools: list[Any] = []
# id(pool) -> the created_ns of its segment (a closed pool no longer has a view to read it from).
_created: dict[int, int] = {}


def _run_dir() -> str | None:
    return os.environ.get(RUN_DIR_ENV) or None


def _append(name: str, line: str) -> None:
    """Append one line to a run-directory file (O_APPEND: lines of many processes stay whole)."""
    run_dir = _run_dir()
    if run_dir is None:
        return
    fd = os.open(os.path.join(run_dir, name), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def pool_key(name: str, created_ns: int) -> str:
    """Names one creation of a pool (a name can be unlinked and created again)."""
    return f"{name}.{created_ns}"


def on_open(pool: Any) -> None:
    """OPEN_HOOKS entry: record the pool and its intact header for the supervisor."""
    run_dir = _run_dir()
    if run_dir is None:
        return
    created = int(pool.view.h["created_ns"])
    hdr = os.path.join(run_dir, "hdr." + pool_key(pool.name, created))
    if not os.path.exists(hdr):
        with open(hdr, "wb") as f:
            f.write(pool.view.raw[:HEADER_PREFIX_BYTES].tobytes())
    _append("pools", f"{pool.name}\t{created}\t{segment_path(pool.name)}")
    _pools.append(pool)
    _created[id(pool)] = created


def on_unlink(pool: Any) -> None:
    """UNLINK_HOOK: rename the pool's files aside; the supervisor unlinks them after the dump."""
    created = _created.get(id(pool), 0)
    aside = f"{pool.name}.unlinked-{os.getpid()}-{created % 10**9}"
    try:
        os.rename(segment_path(pool.name), segment_path(aside))
    except FileNotFoundError:
        return
    try:
        os.rename(data_path(pool.name), data_path(aside))
    except FileNotFoundError:
        pass
    _append("unlinks", f"{pool.name}\t{created}\t{segment_path(aside)}")


def check_at_exit() -> dict[str, Any]:
    """Report this process's leaks into each pool's findings ring; close pools that are clean."""
    out: dict[str, Any] = {}
    me = os.getpid()
    for pool in _pools:
        if pool._closed or pool.pid != me:
            continue
        held = 0
        seqs = [s for s in pool._seqs.values() if s.block_table]
        for seq in seqs:
            held += len(seq.block_table)
            pool.report(
                Finding(
                    "leak_finished",
                    f"request {seq.request_id!r} still held {len(seq.block_table)} block(s) when"
                    " the process exited: free or abort every sequence when its request ends",
                    block=seq.block_table[0],
                    owner_pid=me,
                    request=str(seq.request_id)[:32],
                )
            )
        # The local cache is not a leak: hand it back before looking for orphans.
        pool._run({pool.FREE}, pool._flush_local)
        mine = [f for f in pool.check() if f.owner_pid in (None, me)]
        for f in mine[:MAX_EXIT_FINDINGS]:
            pool.report(f)
        orphans = sum(1 for f in mine if f.kind == "leak_orphan")
        out[pool.name] = {"sequences": len(seqs), "blocks": held, "findings": len(mine)}
        if not seqs and not orphans:
            pool.close()
    return out


def _at_exit() -> None:
    try:
        found = check_at_exit()
    except Exception as e:  # noqa: BLE001 - the check must never hide the script's own exit
        print(f"kvscope: leak check at exit failed: {e}", file=sys.stderr)
        return
    run_dir = _run_dir()
    if run_dir is not None:
        with open(os.path.join(run_dir, f"exit.{os.getpid()}"), "w") as f:
            json.dump(found, f)


def _record_exception(e: BaseException) -> None:
    run_dir = _run_dir()
    if run_dir is None:
        return
    frames = traceback.extract_tb(e.__traceback__)
    last = frames[-1] if frames else None
    where = f"{last.filename}:{last.lineno} in {last.name}" if last else ""
    with open(os.path.join(run_dir, "exception"), "w") as f:
        json.dump({"type": type(e).__name__, "message": str(e)[:500], "where": where}, f)


def probe_env() -> dict[str, str]:
    """The probe settings this process runs with (set by the supervisor)."""
    return {k: v for k, v in os.environ.items() if k.startswith("KVSCOPE_")}


def install() -> None:
    """Install the harness hooks, the exit check and, when present, the probes."""
    pool_module.OPEN_HOOKS.append(on_open)
    pool_module.UNLINK_HOOK = on_unlink
    atexit.register(_at_exit)
    probes = importlib.import_module("kvscope.probes")
    setup = getattr(probes, "install_from_env", None)
    if setup is not None:
        setup()


def main(argv: list[str]) -> int:
    """Run `script.py args` or `-m module args` as __main__ with the hooks installed."""
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
    tb = e.__traceback__
    while tb is not None and (
        tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
        or tb.tb_frame.f_code.co_filename.startswith("<frozen")
    ):
        tb = tb.tb_next
    sys.excepthook(type(e), e.with_traceback(tb), tb)


if __name__ == "__main__":
    # Re-import under the real name so the hooks live in `kvscope.bootstrap`, not in a
    # `__main__` that runpy replaces with the target's.
    from kvscope.bootstrap import main as _main

    sys.exit(_main(sys.argv[1:]))
