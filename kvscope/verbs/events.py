"""Record and check an engine's KV-event stream (vLLM, SGLang): `kvscope events record|check`.

`record ENDPOINT... -o FILE [--topic T] [--replay ENDPOINT...] [--seconds S]` subscribes and
writes every message with its receive time (docs/EVENTS.md); Ctrl-C or `--seconds` stops it.
`check FILE|ENDPOINT... [--json] [--topic T] [--replay ENDPOINT...] [--seconds S]
[--num-blocks N]` checks a recorded stream, or records one for `--seconds` and checks it (with
the engine's pool size N, more blocks stored at once is `kv_event_over_capacity`). Exit code 0 clean (warnings at
most), 1 findings of severity error, 2 unusable input (a stream that holds no batch too).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

from kvscope.errors import EXIT_FINDINGS, EXIT_OK, UsageError

# How long `events check ENDPOINT...` records by default.
DEFAULT_SECONDS = 10.0


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


def _blocks(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of blocks: {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return n


def record(
    endpoints: list[str],
    output: str,
    topic: str,
    replay: list[str] | None,
    seconds: float | None,
    live: bool,
    summary: bool = True,
) -> Any:
    """Record into `output`; the recorder's stats (with `summary`, one line on stderr at the
    end: what the file holds)."""
    from kvscope.events.recorder import Recorder, live_line

    def warn(message: str) -> None:
        # (on a terminal, below the live line, which is drawn again after it)
        lead = "\n" if live else ""
        print(f"{lead}kvscope: warning: {message}", file=sys.stderr, flush=True)

    rec = Recorder(endpoints, output, topic=topic, replay=replay, warn=warn)
    stats = rec.run(seconds=seconds, live=live_line if live else None)
    if live:
        sys.stderr.write("\n")
    if summary:
        rate = stats.events / stats.elapsed_s if stats.elapsed_s > 0 else 0.0
        print(
            f"kvscope: recorded {stats.messages:,} batch(es) ({stats.filled:,} replayed),"
            f" {stats.events:,} event(s) ({rate:,.0f}/s) from {len(stats.publishers)}"
            f" publisher(s) in {stats.elapsed_s:.1f} s; {stats.gaps} gap(s) of"
            f" {stats.missing:,} batch(es), {stats.unfilled:,} not replayed;"
            f" {stats.resets} restart(s)"
            + (f", {stats.interleaved} publisher(s) interleaved" if stats.interleaved else "")
            + f"; wrote {os.path.abspath(output)}",
            file=sys.stderr,
        )
    return stats


def _publisher_line(p: dict[str, Any]) -> str:
    name = (
        f"  {p['endpoint']}"
        + (f" topic {p['topic']!r}" if p["topic"] else "")
        + ("" if p["rank"] is None else f" rank {p['rank']}")
    )
    if p.get("interleaved"):
        return (
            f"{name}: two publishers interleaved, {p['batches']:,} batch(es),"
            f" {p['events']:,} event(s); not checked from where they were found mixed"
        )
    seqs = f"seq {p['first_seq']}..{p['last_seq']}" if p["first_seq"] is not None else "no seq"
    return (
        f"{name}: {seqs}, {p['batches']:,} batch(es), {p['events']:,} event(s),"
        f" {p['blocks_stored']:,} block(s) stored now (peak {p['peak_blocks_stored']:,});"
        f" gaps {p['gaps']} ({p['missing_batches']} batch(es) lost), replayed"
        f" {p['replayed']}, restarts {p['resets']}, reordered {p['reordered']}"
    )


# Failed replays named per endpoint in the text output (the rest counted).
NOTES_SHOWN = 3


def _note_lines(notes: list[dict[str, Any]]) -> list[str]:
    """The recorder's replay notes, per endpoint: requests, batches replayed, the failures."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    lines = []
    for n in notes:
        if n.get("note") == "replay":
            by.setdefault((str(n.get("endpoint", "?")), str(n.get("replay") or "")), []).append(n)
        elif n.get("note") == "restart":
            lines.append(
                f"  {n.get('endpoint', '?')}: the publisher restarted after seq {n.get('seq')}"
                f" (the replay of a gap sent another batch {n.get('seq')}): no gap, its new"
                " sequence asked for from its start"
            )
    for (ep, replay), ns in by.items():
        failed = [n for n in ns if n.get("error")]
        got = sum(n.get("replayed") or 0 for n in ns if isinstance(n.get("replayed"), int))
        # (the replay socket no longer held them all: its buffer had moved on)
        short = [
            n
            for n in ns
            if not n.get("error")
            and all(isinstance(n.get(k), int) for k in ("first", "stop", "replayed"))
            and n["replayed"] < n["stop"] - n["first"]
        ]
        lines.append(
            f"  replays for {ep}" + (f" from {replay}" if replay else "") + f": {len(ns)}"
            f" request(s), {got:,} batch(es) replayed, {len(failed)} failed"
            + (f", {len(short)} short of what was asked" if short else "")
        )
        for n in failed[:NOTES_SHOWN]:
            first, stop = n.get("first"), n.get("stop")
            seqs = (
                f"seq {first}..{stop - 1}"
                if isinstance(first, int) and isinstance(stop, int) and stop - 1 > first
                else f"seq {first}"
            )
            lines.append(f"    {seqs} asked: {n['error']}")
        if len(failed) > NOTES_SHOWN:
            lines.append(f"    ({len(failed) - NOTES_SHOWN} more failed)")
    return lines


def render(report: dict[str, Any], out=None) -> None:
    """The check for a person: headline, publishers, replays, findings with their events."""
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
        print(
            "the file ends inside a record: it was cut short (the recorder killed?), read up to"
            f" its last whole record; {s.get('unread_bytes', 0):,} byte(s) unread in all",
            file=out,
        )
    for p in report["publishers"]:
        print(_publisher_line(p), file=out)
        if not p["complete"] and not p.get("interleaved"):
            print(
                f"    not verifiable in full: {p['incomplete_because']};"
                f" {p['unverifiable']} removal(s) or parent(s) not checked",
                file=out,
            )
    for line in _note_lines(report.get("notes") or []):
        print(line, file=out)
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


def _no_batch(report: dict[str, Any]) -> bool:
    """Whether a check read no published or replayed message at all."""
    s = report["summary"]
    return s["records"] - len(report.get("notes") or []) == 0


def _nothing_in_file(path: str, report: dict[str, Any]) -> str:
    """Why a recorded file holds no batch, in a line."""
    from kvscope.events.streamfile import StreamFile

    s = report["summary"]
    if s["truncated"]:
        return (
            f"{path} holds no KV-event batch: it ends inside its first record"
            f" ({s['unread_bytes']:,} byte(s)), cut short"
        )
    if s["unread_bytes"]:
        return (
            f"{path} holds no KV-event batch: its {s['unread_bytes']:,} byte(s) of records"
            " do not parse (the file is corrupt)"
        )
    stream = StreamFile(path)
    try:
        head = stream.header
    finally:
        stream.close()
    eps = ", ".join(str(e) for e in head.get("endpoints") or []) or "no endpoint"
    topic = f" (topic {head['topic']!r})" if head.get("topic") else ""
    return (
        f"{path} holds no KV-event batch: nothing was recorded from {eps}{topic}; is anything"
        " publishing there" + (" on that topic?" if topic else "?")
    )


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
            "--seconds", type=_seconds, help=f"live: record this long (default {DEFAULT_SECONDS:g})"
        )
        chk.add_argument(
            "--num-blocks",
            type=_blocks,
            metavar="N",
            help="the engine's KV pool size in blocks (vLLM's num_gpu_blocks): more stored at"
            " once is kv_event_over_capacity (removals missing); not for vLLM's 'full' report"
            " mode",
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
        live_only = [
            flag
            for flag, given in (
                ("--seconds", args.seconds is not None),
                ("--replay", bool(args.replay)),
                ("--topic", bool(args.topic)),
            )
            if given
        ]
        if live_only:
            raise UsageError(
                f"{', '.join(live_only)}: for live endpoints; a recorded file is checked whole"
            )
        report = check_file(args.targets[0], args.num_blocks)
        if _no_batch(report):
            raise UsageError(_nothing_in_file(args.targets[0], report))
    else:
        seconds = DEFAULT_SECONDS if args.seconds is None else args.seconds
        fd, tmp = tempfile.mkstemp(prefix="kvscope-events-", suffix=".kvev")
        os.close(fd)
        try:
            # (the check says what was recorded: no line of the recorder's, whose file goes)
            record(endpoints, tmp, args.topic, args.replay, seconds, live=False, summary=False)
            report = check_file(tmp, args.num_blocks)
            report["source"] = " ".join(endpoints)
        finally:
            os.unlink(tmp)
        if _no_batch(report):
            topic = f" on topic {args.topic!r}" if args.topic else ""
            raise UsageError(
                f"no KV-event batch from {' '.join(endpoints)}{topic} in {seconds:g} s: is"
                " anything publishing there" + (" on that topic?" if args.topic else "?")
            )
    if args.json:
        print_json(report)
    else:
        render(report)
    return EXIT_OK if report["healthy"] else EXIT_FINDINGS
