"""Record and check an engine's KV-event stream (vLLM, SGLang): `kvscope events record|check`.

`record ENDPOINT... -o FILE [--topic T] [--replay ENDPOINT...] [--seconds S]` subscribes and
writes every message with its receive time (docs/EVENTS.md); Ctrl-C or `--seconds` stops it.
`check FILE|ENDPOINT... [--json] [--seconds S]` checks a recorded stream, or records one for
`--seconds` and checks it. Exit code 0 clean (warnings at most), 1 findings of severity error,
2 unusable input.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

from kvscope.errors import EXIT_FINDINGS, EXIT_OK, UsageError


def is_endpoint(target: str) -> bool:
    """Whether `target` names a ZMQ endpoint (tcp://, ipc://, inproc://) rather than a file."""
    return "://" in target


def _seconds(value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {value!r}") from None
    if not s > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return s


def record(
    endpoints: list[str],
    output: str,
    topic: str,
    replay: list[str] | None,
    seconds: float | None,
    live: bool,
) -> Any:
    """Record into `output`; the recorder's stats (one line on stderr at the end)."""
    from kvscope.events.recorder import Recorder, live_line

    rec = Recorder(endpoints, output, topic=topic, replay=replay)
    stats = rec.run(seconds=seconds, live=live_line if live else None)
    if live:
        sys.stderr.write("\n")
    rate = stats.events / stats.elapsed_s if stats.elapsed_s > 0 else 0.0
    print(
        f"kvscope: recorded {stats.messages:,} batch(es), {stats.events:,} event(s)"
        f" ({rate:,.0f}/s) from {len(stats.publishers)} publisher(s) in {stats.elapsed_s:.1f} s;"
        f" {stats.gaps} gap(s) of {stats.missing} batch(es), {stats.filled} replayed,"
        f" {stats.resets} restart(s); wrote {os.path.abspath(output)}",
        file=sys.stderr,
    )
    return stats


def render(report: dict[str, Any], out=None) -> None:
    """The check for a person: headline, publishers, findings with their events."""
    out = out or sys.stdout
    s = report["summary"]
    errors = sum(1 for f in report["findings"] if f["severity"] == "error")
    warnings = sum(1 for f in report["findings"] if f["severity"] != "error")
    print(
        f"{report['source']}: {s['batches']:,} batch(es), {s['events']:,} event(s) from"
        f" {s['publishers']} publisher(s); {s['stored']:,} block(s) stored, {s['removed']:,}"
        f" removed, {s['cleared']} clear(s)",
        file=out,
    )
    health = "HEALTHY" if report["healthy"] else "UNHEALTHY"
    counts = s["findings_by_kind"]
    total = sum(counts.values())
    print(
        f"health: {health} ({total} finding(s): {errors} error(s) and {warnings} warning(s) shown)",
        file=out,
    )
    if s["truncated"]:
        print("the file ends inside a record (the recorder was killed): read up to it", file=out)
    for p in report["publishers"]:
        seqs = f"seq {p['first_seq']}..{p['last_seq']}" if p["first_seq"] is not None else "no seq"
        line = (
            f"  {p['endpoint']}"
            + (f" topic {p['topic']!r}" if p["topic"] else "")
            + ("" if p["rank"] is None else f" rank {p['rank']}")
            + f": {seqs}, {p['batches']:,} batch(es), {p['events']:,} event(s),"
            f" {p['blocks_stored']:,} block(s) stored now (peak {p['peak_blocks_stored']:,});"
            f" gaps {p['gaps']} ({p['missing_batches']} batch(es) lost), replayed"
            f" {p['replayed']}, restarts {p['resets']}, reordered {p['reordered']}"
        )
        print(line, file=out)
        if not p["complete"]:
            print(
                f"    not verifiable in full: {p['incomplete_because']};"
                f" {p['unverifiable']} removal(s) or parent(s) not checked",
                file=out,
            )
    for f in report["findings"]:
        print(f"{f['severity']}: {f['kind']}: {f['message']}", file=out)
        for e in f["events"]:
            what = f" ({e['what']})" if e.get("what") else ""
            h = f" {e['hash']}" if "hash" in e else ""
            parent = f" parent {e['parent']}" if "parent" in e else ""
            print(f"    batch {e['batch']} seq {e['seq']}: {e['type']}{h}{parent}{what}", file=out)
    shown = len(report["findings"])
    if total > shown:
        print(f"({total - shown} more finding(s) counted, not shown: {counts})", file=out)


class EventsCommand:
    """Record or check an engine's KV-event stream: `kvscope events record|check ...`."""

    @staticmethod
    def prepare_parser(parser: argparse.ArgumentParser) -> None:
        sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
        rec = sub.add_parser(
            "record",
            help="record a live stream: `events record ENDPOINT... -o FILE`",
            description="Subscribe to KV-event publishers and record every message.",
        )
        rec.add_argument(
            "endpoints", nargs="+", metavar="ENDPOINT", help="publisher, e.g. tcp://host:5557"
        )
        rec.add_argument("-o", "--output", required=True, metavar="FILE", help="stream file")
        rec.add_argument("--topic", default="", help="topic prefix to subscribe to (default all)")
        rec.add_argument(
            "--replay",
            nargs="+",
            metavar="ENDPOINT",
            help="each endpoint's replay socket, to fill gaps from",
        )
        rec.add_argument("--seconds", type=_seconds, help="stop after S seconds (default Ctrl-C)")
        chk = sub.add_parser(
            "check",
            help="check a recorded stream or a live one: `events check FILE|ENDPOINT...`",
            description="Check a KV-event stream's invariants (docs/EVENTS.md).",
        )
        chk.add_argument("targets", nargs="+", metavar="FILE|ENDPOINT")
        chk.add_argument("--json", action="store_true", help="print the check as JSON")
        chk.add_argument("--topic", default="", help="live: topic prefix (default all)")
        chk.add_argument("--replay", nargs="+", metavar="ENDPOINT", help="live: replay sockets")
        chk.add_argument(
            "--seconds", type=_seconds, default=10.0, help="live: record this long (default 10)"
        )

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        if args.action == "record":
            record(
                args.endpoints,
                args.output,
                args.topic,
                args.replay,
                args.seconds,
                live=sys.stderr.isatty(),
            )
            return EXIT_OK
        return check(args)


def check(args: argparse.Namespace) -> int:
    """`events check`: a recorded file, or endpoints recorded for --seconds, then checked."""
    from kvscope.events.checker import check_file
    from kvscope.report import print_json

    endpoints = [t for t in args.targets if is_endpoint(t)]
    if endpoints and len(endpoints) != len(args.targets):
        raise UsageError("events check takes one recorded file or endpoints, not both")
    if not endpoints:
        if len(args.targets) != 1:
            raise UsageError("events check takes one recorded file")
        if not os.path.exists(args.targets[0]):
            raise UsageError(f"no such file: {args.targets[0]}")
        report = check_file(args.targets[0])
    else:
        fd, tmp = tempfile.mkstemp(prefix="kvscope-events-", suffix=".kvev")
        os.close(fd)
        try:
            record(endpoints, tmp, args.topic, args.replay, args.seconds, live=False)
            report = check_file(tmp)
            report["source"] = " ".join(endpoints)
        finally:
            os.unlink(tmp)
    if args.json:
        print_json(report)
    else:
        render(report)
    return EXIT_OK if report["healthy"] else EXIT_FINDINGS
