"""Re-run an operation log against a fresh pool and stop at the first divergence or finding: `kvscope replay LOG [--until N] [--shrink] [--emit-script FILE]`.

LOG is what `kvscope run --record-ops FILE` (or `PoolConfig(record_ops=FILE)`) recorded; a dump
FILE.kvd is replayed from the log FILE.kvd.ops beside it. Every operation runs again, in the
recorded order, on a fresh pool of the recorded geometry, probes and armed faults, and each
result (status, block ids, hits, copy-on-write copies, preemptions, findings) is compared with
the recorded one. `--shrink` reduces the run to a minimal one that still finds the same kind;
`--emit-script FILE` writes it as a Python script (docs/REPLAY.md).

Exit code 0 when the replay ran to the end (or to --until) with every result as recorded and no
finding of severity error, 1 when it stopped at a divergence or at a finding of severity error,
2 on unusable input (an unreadable, truncated or edited log: one line).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

from kvscope.errors import PoolError, UsageError


class ReplayCommand:
    """Re-run an operation log against a fresh pool and stop at the first divergence or finding: `kvscope replay LOG [--until N] [--shrink] [--emit-script FILE]`."""

    @staticmethod
    def prepare_parser(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("target", metavar="DUMP|LOG", help="an operation log (or a dump)")
        parser.add_argument(
            "--until", type=int, metavar="N", help="stop after the operation numbered N"
        )
        parser.add_argument("--json", action="store_true", help="print the outcome as JSON")
        parser.add_argument("--pool", metavar="NAME", help="the pool to replay (a log of several)")
        parser.add_argument(
            "--shrink",
            action="store_true",
            help="reduce the run to a minimal one that still finds the same kind",
        )
        parser.add_argument(
            "--emit-script",
            metavar="FILE",
            help="write the minimal run as a Python script (implies --shrink)",
        )

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        from kvscope.allocator.oplog import OplogError, read_log
        from kvscope.replay import Shrinker, emit_script, replay

        if args.until is not None and args.until < 0:
            raise UsageError("--until takes an operation number >= 0")
        path = args.target
        dumped = None
        if path.endswith(".kvd"):
            if not os.path.exists(path + ".ops"):
                raise UsageError(
                    f"{path}: a dump holds no operation log; record one with `kvscope run "
                    f"--record-ops FILE` (a dump's log is read from {path}.ops)"
                )
            dumped = dumped_pool(path)
            if args.pool is not None and args.pool != dumped[0]:
                raise UsageError(f"{path} is a dump of pool {dumped[0]!r}, not {args.pool!r}")
            path += ".ops"
        try:
            log = read_log(path, dumped[0] if dumped else args.pool)
        except OplogError as e:
            if dumped is None:
                raise UsageError(str(e)) from None
            raise UsageError(
                f"{path} is not the log of the pool {args.target} is a dump of ({e})"
            ) from None
        if dumped is not None:
            same_log_as_dump(log, args.target, *dumped)
        outcome = replay(log, args.until, quiet=args.json)
        report: dict[str, Any] = outcome_dict(log, outcome)
        if args.until is not None and outcome.reason == "end" and log.records:
            # (an --until past the log's last operation: the whole log was replayed)
            report["until_past_end"] = {"until": args.until, "last": log.records[-1].seq}
        shrunk = None
        stopped = 0
        if args.shrink or args.emit_script:
            shrinker = Shrinker(log, outcome)
            progress = shrinker.progress = _Progress(len(shrinker.ops))
            # (SIGINT or SIGTERM mid-shrink: what it found so far is kept, not lost)
            was = signal.signal(signal.SIGTERM, _stop)
            try:
                shrunk = shrinker.shrink()
            except KeyboardInterrupt as e:
                stopped = 143 if isinstance(e, _Stopped) else 130
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                shrunk = shrinker.so_far()
            finally:
                signal.signal(signal.SIGTERM, was)
                progress.done()
        if stopped and shrunk is None:
            report["shrunk"] = {"kind": shrinker.kind, "interrupted": True, "tests": shrinker.tests}
        elif shrunk is not None:
            report["shrunk"] = {
                "kind": shrunk.kind,
                "operations": [r.to_dict() for r in shrunk.ops],
                "tests": shrunk.tests,
                "seconds": round(shrunk.seconds, 3),
            }
            if shrunk.partial:
                report["shrunk"]["interrupted"] = True
            if args.emit_script:
                try:
                    with open(args.emit_script, "w") as f:
                        f.write(emit_script(shrunk))
                except OSError as e:
                    raise UsageError(f"{args.emit_script}: {e.strerror or e}") from None
                report["shrunk"]["script"] = args.emit_script
        if args.json:
            json.dump(report, sys.stdout, indent=2, default=str)
            sys.stdout.write("\n")
        else:
            render(report)
        sys.stdout.flush()
        return stopped or outcome.exit_code


class _Stopped(KeyboardInterrupt):
    """SIGTERM during a shrink, raised where it lands (as SIGINT's KeyboardInterrupt is)."""


def _stop(signum: int, frame: Any) -> None:
    raise _Stopped()


def dumped_pool(path: str) -> tuple[str, int]:
    """The name and creator pid of the pool a dump file is of."""
    from kvscope.allocator.dumpread import read_dump
    from kvscope.allocator.layout import field_text

    try:
        view, _ = read_dump(path)
    except PoolError as e:
        raise UsageError(str(e)) from None
    return field_text(view.h["name"]), int(view.h["creator_pid"])


def same_log_as_dump(log: Any, dump: str, name: str, creator: int) -> None:
    """UsageError (one line) where a dump's log is of another pool of the same name: its
    recording from the pool's creation names another creating process."""
    start = log.start.start or {}
    pid = int(start.get("pid", 0) or 0)
    if start.get("created") and pid and pid != creator:
        raise UsageError(
            f"{log.path} is the log of another pool named {name!r} (created by pid {pid}; the"
            f" pool {dump} is a dump of was created by pid {creator})"
        )


class _Progress:
    """A shrink's progress on stderr (its runs can take minutes): rewritten in place every
    half second on a terminal, a line every 10 s otherwise."""

    def __init__(self, total: int):
        self.total = total
        self.t0 = self.said = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.shown = False

    def __call__(self, runs: int, left: int) -> None:
        now = time.monotonic()
        if now - self.said < (0.5 if self.tty else 10.0):
            return
        self.said = now
        line = (
            f"kvscope replay: shrinking: {runs} runs, {left} of {self.total} operation(s) "
            f"left, {now - self.t0:.0f} s"
        )
        sys.stderr.write(f"\r{line}\x1b[K" if self.tty else line + "\n")
        sys.stderr.flush()
        self.shown = True

    def done(self) -> None:
        if self.shown and self.tty:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def outcome_dict(log: Any, outcome: Any) -> dict[str, Any]:
    start = log.start.start or {}
    d: dict[str, Any] = {
        "log": log.path,
        "pool": start.get("pool"),
        "config": start.get("config"),
        "probes": start.get("probes"),
        "faults": start.get("faults"),
        "processes": len({r.pid for r in log.records}),
        "operations": outcome.total,
        "replayed": outcome.replayed,
        "reason": outcome.reason,
        "seconds": round(outcome.seconds, 4),
        "ops_per_s": round(outcome.replayed / outcome.seconds) if outcome.seconds else None,
        "exit_code": outcome.exit_code,
    }
    if outcome.record is not None:
        d["operation"] = outcome.record.to_dict()
        from kvscope.replay import recorded_result

        d["recorded"] = recorded_result(outcome.record).to_dict()
    if outcome.got is not None:
        d["replayed_result"] = outcome.got.to_dict()
    if outcome.lost is not None:
        d["lost"] = list(outcome.lost)
    if outcome.unrecorded is not None:
        d["unrecorded"] = outcome.unrecorded
    if outcome.answered_at:
        # (the recording learned the operation's findings there: its device checks' answers)
        d["answered_at"] = outcome.answered_at
    if log.others:
        d["other_pools"] = log.others
    if log.snapshot is not None:
        # where it starts: a snapshot of the pool (docs/REPLAY.md "Starting from a snapshot"),
        # a bounded log's checkpoint where it wrapped (its older records dropped)
        ring = log.snapshot.meta.get("ring")
        d["snapshot"] = {
            "operation": log.start.seq,
            "pid": log.start.pid,
            "checkpoint": ring is not None,
            "dropped_bytes": log.dropped,
        }
    d["differs"] = outcome.diff
    d["blocks"] = outcome.blocks
    note = _bytes_note(log, d)
    if note:
        d["note"] = note
    return d


# Findings of a check of the K/V bytes: where the program's writes are not in the log, the
# replay's K/V is not the program's and they cannot come back (docs/REPLAY.md "What replays")
BYTE_KINDS = ("kv_never_written", "published_block_modified", "use_after_free", "guard_violation")


def _bytes_note(log: Any, d: dict[str, Any]) -> str:
    """Why a divergence on a finding of the K/V bytes is no replay bug: the log holds none of
    the program's K/V writes (no store given its writers), or not its copies (a copy-on-write
    pair without a COPY record), or not the write that made it (its stores replayed, and the
    finding did not come back); '' where it is no such finding."""
    if d["reason"] != "divergence" or "found" not in d["differs"]:
        return ""
    rec = {(f["kind"], f["block"]) for f in (d.get("recorded") or {}).get("found", [])}
    got = {(f["kind"], f["block"]) for f in (d.get("replayed_result") or {}).get("found", [])}
    kinds = sorted({k for k, _ in rec - got if k in BYTE_KINDS})
    if not kinds:
        return ""
    from kvscope.allocator.oplog import OpCode

    stores = any(r.op == int(OpCode.STORE) for r in log.records)
    why, fix = [], []
    if not stores:
        why.append("no K/V store of the program was given its writers (no STORE record)")
        fix.append("give store_kv its writers=Writers(...)")
    if not log.replays_kv():
        # (append returned copy-on-write pairs and no COPY record came: copies made without
        # telling the pool, or none made, a skipped copy's bug, which the log cannot tell apart)
        why.append(
            "its copy-on-write copies are not in the log (copy_blocks without pool=, or the"
            " copies skipped: with every copy skipped the log cannot tell the two apart)"
        )
        fix.append("call copy_blocks with pool=")
    if not why:
        # (every store and copy the log holds replayed, and the finding did not come back:
        # the write that made it is one the log does not hold)
        why.append(
            "the write that made it is not among the log's stores (a store not given its"
            " writers: a kernel of the program's own, a write through a table it kept after"
            " the sequence's end)"
        )
        fix.append("give every store_kv its writers")
    return (
        f"{', '.join(kinds)} judges the K/V bytes the program wrote, and the log holds not all of"
        f" them: {'; '.join(why)}. The replay's K/V is not the program's, so this finding does"
        ' not come back; the recording found it (docs/REPLAY.md "What replays"; '
        f"{' and '.join(fix)} to replay it)"
    )


def render(d: dict[str, Any]) -> None:
    cfg = d.get("config") or {}
    print(
        f"replay {d['log']}: pool {d['pool']!r} ({cfg.get('num_blocks')}x{cfg.get('block_size')}),"
        f" {d['operations']} operation(s) from {d['processes']} process(es)"
    )
    rate = f", {d['ops_per_s']:,} ops/s" if d.get("ops_per_s") else ""
    reason = d["reason"]
    head = {
        "end": "every result as recorded, to the end of the log",
        "until": "every result as recorded, up to --until",
        "divergence": "DIVERGED from the recording",
        "finding": "reproduced the recorded run up to a finding",
        "missing": "stopped: the log names a process or sequence the replay does not have",
        "lost": "stopped where records are missing from the log",
    }[reason]
    if d.get("other_pools"):
        names = ", ".join(repr(n) for n in d["other_pools"])
        print(f"the log also holds pool(s) {names}, not replayed (--pool NAME replays one)")
    snap = d.get("snapshot")
    if snap is not None:
        how = "a bounded log's checkpoint" if snap["checkpoint"] else "a snapshot of the pool"
        wrapped = (
            f"; the ring wrapped: the file's first {snap['dropped_bytes']} bytes were dropped"
            if snap["dropped_bytes"]
            else ""
        )
        print(f"started from {how} at operation {snap['operation']}{wrapped}")
    print(f"{head} ({d['replayed']} operation(s) replayed in {d['seconds']} s{rate})")
    past = d.get("until_past_end")
    if past:
        print(
            f"--until {past['until']} is past the log's last operation ({past['last']}): the"
            " whole log was replayed"
        )
    if d.get("lost"):
        a, b = d["lost"]
        print(
            f"operations {a}..{b} are not in the log (a process killed before it wrote them, "
            "a failed write, or a process that did not record)"
        )
    if d.get("unrecorded") is not None:
        print(
            f"operations the pool ran before operation {d['unrecorded']} are not in the log "
            "(a handle that ran operations unrecorded began recording there, and no snapshot "
            "follows: a redacted recording writes none)"
        )
    op = d.get("operation")
    if op is not None:
        who = f"pid {op['pid']} thread {op['tid']}"
        target = f" request {op['request']!r}" if op.get("request") else ""
        print(f"\noperation {op['seq']} ({who}): {op['op']}{target}")
        if op.get("tokens"):
            t = op["tokens"]
            print(f"  tokens {t[:16]}{' ...' if len(t) > 16 else ''} ({len(t)})")
        if op.get("lease"):
            ls = op["lease"]
            when = f", deadline_ns {ls['deadline_ns']}" if op["op"] == "lease" else ""
            print(
                f"  lease {ls['lease_id']} ({ls['mode'] or '-'}, holder {ls['holder']!r}, "
                f"record {ls['record']}{when})"
            )
        if op["op"] == "expire_leases":
            print(f"  now_ns {op.get('arg')}")
        if op.get("store"):
            st = op["store"]
            spans = ", ".join(f"{i}:[{a}, {b})" for i, a, b in st["spans"])
            print(f"  store check of {'+'.join(st['checked'])}: writers {spans}")
            if st["slots"]:
                sl = st["slots"]
                print(f"  slots {sl[:16]}{' ...' if len(sl) > 16 else ''} ({len(sl)})")
        rec, got = d.get("recorded"), d.get("replayed_result")
        if rec is not None:
            print(f"  {'':10}  {'recorded':34}  replayed")
            keys = ["status", "seq_id", "result", "blocks", "copies", "preempted", "found"]
            if "lease" in rec or (got and "lease" in got):
                keys.append("lease")  # (a lease's take: its record and generations)
            for key in keys:
                a = _short(rec.get(key))
                b = _short(got.get(key)) if got else "-"
                mark = "  <- differs" if key in d["differs"] else ""
                print(f"  {key:10}  {a:34}  {b}{mark}")
            if got and got.get("error"):
                print(f"  replayed error: {got['error']}")
            if d.get("answered_at"):
                at = ", ".join(str(a) for a in d["answered_at"])
                print(
                    f"  (recorded found: the answer of a device check this operation queued, "
                    f"applied at a later settle: REPORT {at})"
                )
        if d.get("note"):
            print(f"  note: {d['note']}")
        if d.get("blocks"):
            print("\nblocks involved (recorded vs replayed; the replay pool's record now)")
            print(f"  {'block':>5}  {'recorded':18}  {'replayed':18}  state      ref  allocated by")
            for b in d["blocks"]:
                print(
                    f"  {b['block']:>5}  {b['recorded']:18}  {b['replayed']:18}  "
                    f"{b['state']!s:9}  {b['refcount']:>3}  {b['request']}"
                )
    s = d.get("shrunk")
    if s and "operations" not in s:
        print(
            f"\nshrink interrupted after {s['tests']} run(s), before any smaller run found"
            f" {s['kind']!r}: nothing shrunk"
        )
    elif s:
        if s.get("interrupted"):
            print(
                f"\nshrink interrupted: the smallest run found so far, {len(s['operations'])}"
                f" operation(s), still finds {s['kind']!r} ({s['tests']} runs, {s['seconds']} s;"
                " not minimal: run the shrink again for that)"
            )
        else:
            print(
                f"\nshrunk to {len(s['operations'])} operation(s) that still find {s['kind']!r}"
                f" ({s['tests']} runs, {s['seconds']} s)"
            )
        for o in s["operations"]:
            tok = f" tokens {len(o['tokens'])}" if o.get("tokens") else ""
            if o["op"] == "copy":  # (a program's copy of blocks: no request, its pairs)
                pairs = ", ".join(f"{a}->{b}" for a, b in o.get("copies", []))
                print(f"  {o['seq']:>8}  pid {o['pid']}  {o['op']:14} blocks {pairs}")
                continue
            print(f"  {o['seq']:>8}  pid {o['pid']}  {o['op']:14} {o['request']!r}{tok}")
        if s.get("script"):
            print(f"script: {s['script']} (python {s['script']}: exit 1 when it finds it)")


def _short(v: Any) -> str:
    if isinstance(v, list) and v and isinstance(v[0], dict):
        # a finding on no block (block -1: a release of a sequence already ended) is its kind alone
        text = ", ".join(
            x["kind"] if x.get("block", -1) < 0 else f"{x['kind']}@{x['block']}" for x in v
        )
    else:
        text = str(v)
    return text if len(text) <= 34 else text[:31] + "..."
