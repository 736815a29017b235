"""Check a live pool: the same analysis as `analyze`, read without locking the pool.

`--repair` attaches to the pool, rolls back the journals of processes that died mid-operation
and returns the blocks of dead owners to the free ring, ends the sequences that processes left
live when they closed their handles (returning their blocks), makes the lease section agree with
itself (leases no holder would release ended, each block's lease count recounted), marks the
recorded findings it answered (those processes' leaks and the locks they died holding) as
repaired, then says what it did and checks again.
Exit code 0 when healthy (after repair), 1 when a finding of severity error remains.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from typing import Any

from kvscope.allocator.errors import FormatVersionError
from kvscope.allocator.process import mapping
from kvscope.allocator.ranges import repair_blocker
from kvscope.allocator.segment import check_name, data_path, segment_path
from kvscope.analysis import analyze_view, exit_code
from kvscope.errors import PoolError, UsageError
from kvscope.poolsummary import some
from kvscope.report import print_json, render
from kvscope.target import add_trust_owner, live_target, read_live, removed_meanwhile
from kvscope.verbs.analyze import add_pool_context


def repair(name: str, trust_owner: bool = False) -> dict[str, Any]:
    """Roll back dead holders' journals and reclaim dead owners' blocks; what was done.

    Safe beside other processes that reclaim at the same time: it reports what this repair
    did (an attach to a full client table reclaims one dead process first). A dead process's
    journal that cannot be trusted is skipped and said to be (csrc/recovery.c journal_problem)."""
    from kvscope.allocator import KVPool

    pool = KVPool.attach(name, trust_owner)
    done: list[dict[str, Any]] = list(pool.reclaimed_at_attach)
    try:
        cached = pool.stats()["num_cached"]
        pool.reclaim_dead(done)
        # the sequences of processes that closed their handles without ending them
        orphans = pool.reclaim_orphans()
        # (after the reclaims: a dead holder's leases went with its blocks)
        leases = pool.repair_leases()
        cleared = pool.clear_repaired({d["pid"] for d in done} | {o["pid"] for o in orphans})
        # (published blocks no request holds now: back in the prefix cache, not freed)
        cached = max(0, pool.stats()["num_cached"] - cached)
    finally:
        pool.close()
    return {
        "journals_rolled_back": [
            {"pid": d["pid"], "entries": d["entries"], "skipped": d["skipped"]}
            for d in done
            if d["entries"] or d["skipped"]
        ],
        "dead_owners": [d["pid"] for d in done if d["detached"]],
        "processes": sum(d["detached"] for d in done),
        "sequences": sum(d["sequences"] for d in done),
        "requests": [r for d in done for r in d.get("requests", ())],
        "blocks": sum(d["blocks"] for d in done),
        "blocks_cached": cached,
        "findings_cleared": [f.to_dict() for f in cleared],
        "leases": leases,
        "orphans": orphans,
    }


def _n(count: int, noun: str) -> str:
    """`1 block`, `2 blocks`."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def describe_repair(done: dict[str, Any]) -> str:
    """One line saying what --repair did."""
    parts = []
    for j in done["journals_rolled_back"]:
        if j.get("skipped"):
            parts.append(
                f"skipped the undo journal of dead pid {j['pid']} ({j['skipped']}): its last operation was not rolled back"
            )
        else:
            parts.append(f"rolled back {j['entries']} journal entries of dead pid {j['pid']}")
    if done["processes"]:
        pids = ", ".join(map(str, done["dead_owners"]))
        requests = done.get("requests") or []
        names = f" ({some(repr(r) for r in requests)})" if requests else ""
        parts.append(
            f"reclaimed {_n(done['sequences'], 'sequence')}{names} from"
            f" {done['processes']} dead process(es) (pid {pids}): {_n(done['blocks'], 'block')}"
            " freed"
            + (
                f" and {done['blocks_cached']} back in the prefix cache (published blocks no"
                " request holds now: the next prompt that shares them hits them, and they are"
                " evicted when blocks are needed)"
                if done.get("blocks_cached")
                else ""
            )
            + ", the blocks they shared with live ones losing a reference"
        )
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for o in done.get("orphans", []):
        by_pid.setdefault(o["pid"], []).append(o)
    for pid, ended in by_pid.items():
        returned = sum(o["blocks"] for o in ended)
        parts.append(
            f"ended {_n(len(ended), 'sequence')} that pid {pid} left live when it closed the pool"
            f" ({some(repr(o['request']) for o in ended)}), returning {_n(returned, 'block')}"
            " to the free ring"
        )
    leases = done.get("leases") or {}
    if leases.get("ended"):
        ids = ", ".join(map(str, leases["ended"]))
        parts.append(f"ended {len(leases['ended'])} lease(s) no holder would release (id {ids})")
    if leases.get("counts"):
        parts.append(f"recounted the lease counts of {leases['counts']} block(s)")
    if leases.get("header"):
        parts.append(f"set the lease header's {', '.join(leases['header'])} to its records'")
    if done.get("findings_cleared"):
        kinds = Counter(f["kind"] for f in done["findings_cleared"])
        listed = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
        parts.append(f"cleared the recorded findings it repaired ({listed})")
    return "repair: " + ("; ".join(parts) if parts else "nothing to repair")


def segment_path_or_none(name: str) -> str:
    """The pool's segment file for a valid pool name, else "" (no pool can be there)."""
    try:
        return segment_path(check_name(name))
    except PoolError:
        return ""


class CheckCommand:
    """Check a live pool (`--repair` reclaims what dead processes left behind)."""

    @staticmethod
    def prepare_parser(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("name", metavar="NAME", help="the pool's name (see `kvscope ls`)")
        parser.add_argument(
            "--repair",
            action="store_true",
            help="roll back dead holders' journals and reclaim dead owners' blocks",
        )
        parser.add_argument(
            "--unlink",
            action="store_true",
            help="remove the pool's files after the check (refused while a live process is attached)",
        )
        parser.add_argument("--json", action="store_true", help="print the report as JSON")
        add_trust_owner(parser)

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        if os.path.lexists(args.name) and not os.path.lexists(segment_path_or_none(args.name)):
            # a dump file given to the verb that only opens live pools
            raise UsageError(
                f"{args.name} is a file, and check opens a live pool by name (see `kvscope ls`);"
                f" `kvscope analyze {args.name}` reads a dump"
            )
        check_name(args.name)
        done = None
        if args.repair:
            # A missing or corrupt pool fails here, before attaching; a damaged one is refused.
            blocker = repair_blocker(read_live(args.name, args.trust_owner))
            if blocker is not None:
                raise UsageError(
                    f"pool {args.name!r} cannot be repaired safely: {blocker}; see `kvscope check {args.name}`"
                )
            done = repair(args.name, args.trust_owner)
            print(describe_repair(done), file=sys.stderr)
        try:
            t = live_target(args.name, args.trust_owner)
        except FormatVersionError as e:
            if args.unlink and not args.repair:
                unlink_other_version(args.name, e.version)
                return 0
            raise PoolError(
                f"{e}: a pool of an older or newer kvscope; `kvscope check {args.name} --unlink`"
                " removes it once no process maps it"
            ) from None
        got = t.findings()
        report = analyze_view(t.view, alive=t.alive, findings=got.findings, kv=got.kv)
        add_pool_context(report, t, None)  # (as analyze NAME: the same analysis)
        removed_meanwhile(args.name)
        if done is not None:
            report["repair"] = done
        if args.json:
            print_json(report)
        else:
            render(report, title="live pool")
        if args.unlink:
            unlink(args.name, report["summary"].get("processes", {}).get("alive", []))
        return exit_code(report)


def remove_files(name: str) -> None:
    """The pool's segment and data files removed (either may be gone already)."""
    for p in (segment_path(name), data_path(name)):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def unlink_other_version(name: str, version: int) -> None:
    """Remove the files of a pool of another format version (none of it is read), unless a
    process maps them still (its kvscope's processes: /proc/PID/maps)."""
    users = mapping([segment_path(name), data_path(name)])
    if users:
        raise UsageError(
            f"pool {name!r} (format version {version}) is still mapped by pid"
            f" {', '.join(map(str, users))}; stop them before --unlink"
        )
    remove_files(name)
    print(
        f"unlinked pool {name!r} (format version {version}, which this kvscope does not read:"
        " not checked; no process maps it)",
        file=sys.stderr,
    )


def unlink(name: str, alive: list[int]) -> None:
    """Remove a pool's files, unless a live process still uses it."""
    if alive:
        raise UsageError(
            f"pool {name!r} is still in use by pid {', '.join(map(str, alive))}; stop them before --unlink"
        )
    remove_files(name)
    print(f"unlinked pool {name!r}", file=sys.stderr)
