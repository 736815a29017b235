"""Rendering an analysis (kvscope.analysis) for a person: health, findings by severity, summary.

rich is imported by the functions that print for a person: `--json` output needs none of it.
"""

from __future__ import annotations

import datetime
import json
import sys
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console


def escape(text: str) -> str:
    """`text` with rich's markup escaped (it may hold brackets: a request id, a path)."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def console(file: IO[str] | None = None) -> Console:
    """A rich console on file (stdout by default), plain when it is not a terminal."""
    from rich.console import Console

    out = file or sys.stdout
    # Not a terminal (a pipe, a file, a test): wide lines rather than wrapped tables.
    width = None if out.isatty() else 200
    return Console(file=out, highlight=False, soft_wrap=True, width=width)


def when_text(ns: int) -> str:
    """A wall-clock time (ns since the epoch) as every reader prints a moment: date and time to
    the millisecond ("?" for none)."""
    if not ns:
        return "?"
    return datetime.datetime.fromtimestamp(ns / 1e9).isoformat(sep=" ", timespec="milliseconds")


def _event_line(e: dict[str, Any], with_block: bool = False) -> str:
    """One flight-recorder event; `with_block`: its block named (a request's events)."""
    req = f" request {e['request']!r}" if e.get("request") else ""
    blk = f"  block {e['block']}" if with_block and e.get("block", -1) >= 0 else ""
    return (
        f"{when_text(e['time_ns'])}  pid {e['pid']}  {e['op']}{blk}  gen {e['generation']}"
        f"  arg {e['arg']}{req}"
    )


# A finding's events shown in the text (newest last); `--json` and the HTML report list every
# event the flight recorder holds.
EVENTS_SHOWN = 8
# Entries printed in full per (kind, allocation site) in each severity: one bug in one code path
# (a skipped copy-on-write copy, a block table kept across a preemption) makes the same finding
# on every request that passes there; the rest are one line naming their requests and blocks
# (the JSON, `report` and `--request R` keep each one)
SAME_CAUSE_SHOWN = 3

# The version of every `--json` output's shape (docs/CLI.md): +1 when a key changes meaning or
# goes away; new keys do not change it.
JSON_SCHEMA = 1


def print_json(report: dict[str, Any], file: IO[str] | None = None) -> None:
    """The report as one JSON object (docs/CLI.md's schema), `"schema": JSON_SCHEMA` first."""
    out = file or sys.stdout
    json.dump({"schema": JSON_SCHEMA, **report}, out, indent=2, default=str)
    out.write("\n")


def _memory(con: Any, pool: dict[str, Any]) -> None:
    """A live pool on a GPU: its KV bytes beside that GPU's memory now (NVML)."""
    gpu = pool.get("gpu")
    if not gpu or "data_bytes" not in pool:
        return
    share = pool["data_bytes"] / gpu["total"] if gpu["total"] else 0.0
    con.print(
        escape(
            f"KV data {pool['data_bytes'] / 2**30:.2f} GiB ({share:.1%} of the GPU); "
            f"GPU {gpu['index']} {gpu['name']} (NVML): {gpu['used'] / 2**30:.2f} GiB used "
            f"of {gpu['total'] / 2**30:.2f} GiB"
        )
    )


def render(report: dict[str, Any], con: Console | None = None, *, title: str = "") -> None:
    """Health, findings by severity (owner, site, last events, first bad event), summary."""
    con = con or console()
    pool = report["pool"]
    geo = pool["geometry"]
    flags = ", ".join(f"{k} {'on' if v else 'off'}" for k, v in pool["flags"].items())
    con.print(f"[bold]{escape(title or 'pool')} {pool['name']!r}[/bold]")
    dump = pool.get("dump")
    if dump:
        why = f": {dump['reason']}" if dump["reason"] else ""
        notes = [n for n in ("redacted", "with_data", "torn") if dump[n]]
        extra = f" ({', '.join(notes)})" if notes else ""
        con.print(
            escape(
                f"dump written {when_text(dump['created_ns'])} about pid {dump['pid']}"
                f" on {dump['host'] or '?'}{why}{extra}"
            )
        )
    con.print(
        escape(
            f"{geo['num_blocks']} blocks x {geo['block_size']} tokens, {geo['num_layers']} layer{'' if geo['num_layers'] == 1 else 's'}, "
            f"{geo['num_kv_heads']} kv heads x {geo['head_dim']}, {geo['dtype']} on {pool['device']};"
            f" probes: {flags}"
        )
    )
    _memory(con, pool)
    data = report.get("data_checks")
    if data and not data["checked"]:
        con.print(escape(f"note: {data['unchecked']}"))
    findings = report["findings"]
    errors = [f for f in findings if f["severity"] == "error"]
    warnings = [f for f in findings if f["severity"] != "error"]
    # (each finding the check counted past its cap too, as its "N more ... (M in all)" line does)
    n_errors, n_warnings = counted(errors), counted(warnings)
    unlisted = sum(_unlisted(f) for f in findings)
    # the findings below are those listed: said when some are only counted
    also = f"; {unlisted} of them counted, not listed" if unlisted else ""
    if report["healthy"] and not warnings:
        con.print("[bold green]health: OK[/bold green] - no findings")
    elif report["healthy"]:
        con.print(f"[bold yellow]health: OK with {n_warnings} warning(s)[/bold yellow]{also}")
        dead = counted([f for f in warnings if f["kind"] == "leak_dead_owner"])
        if dead:
            con.print(
                f"  {dead} of them leak_dead_owner: blocks a dead process still held (on a live "
                "pool, `kvscope check --repair` returns them); `kvscope run`'s default "
                "--fail-on leak counts them as errors"
            )
    else:
        con.print(
            f"[bold red]health: UNHEALTHY[/bold red] - {n_errors} error(s), {n_warnings}"
            f" warning(s){also}"
        )
    for cause in report.get("likely_causes", ()):
        con.print(f"[bold]likely cause:[/bold] {escape(cause)}")
    for label, group, style in (("errors", errors, "red"), ("warnings", warnings, "yellow")):
        if group:
            con.print(f"\n[bold {style}]{label}[/bold {style}]")
            _findings(con, grouped(group), style)
    for key in ("block", "request"):
        if key in report:
            _focus(con, key, report[key])
    _summary(con, report.get("summary") or {})
    if report.get("capacity"):
        _capacity(con, report["capacity"])


def counted(findings: list[dict[str, Any]]) -> int:
    """How many findings `findings` stand for: one each, but the one that counts the findings
    of a kind past the check's cap ("46 more leak_dead_owner findings not listed (96 in all)",
    its `not_listed` the count of each owner and request) stands for those it counts."""
    return sum(_unlisted(f) or 1 for f in findings)


def _unlisted(f: dict[str, Any]) -> int:
    """The findings a finding of the check's counts past its cap (its `not_listed`: owner,
    request, count), 0 for any other."""
    return sum(int(e[2]) for e in f.get("not_listed") or ())


def grouped(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Findings that differ only by block become one entry listing the blocks (the first's
    events; its message's "of this block" then "of each block"), and the blocks of each
    allocation site where they differ (`block_sites`)."""
    out: list[dict[str, Any]] = []
    index: dict[tuple[Any, ...], dict[str, Any]] = {}
    for f in findings:
        key = (f["kind"], f.get("owner_pid"), f.get("request"), f["message"], f.get("source"))
        if f.get("block") is None or key not in index:
            g = dict(f, blocks=[f["block"]] if f.get("block") is not None else [])
            out.append(g)
            if f.get("block") is not None:
                index[key] = g
        else:
            g = index[key]
            g["blocks"].append(f["block"])
            g["message"] = g["message"].replace(" of this block", " of each block")
        if f.get("block") is not None:
            sites = index[key].setdefault("block_sites", {})
            sites.setdefault(f.get("site") or "", []).append(f["block"])
    return out


def _same_cause(f: dict[str, Any]) -> tuple[Any, ...]:
    """What entries of one bug share: their kind and the line that allocated their blocks."""
    return (f["kind"], f.get("site") or "")


def _findings(con: Console, entries: list[dict[str, Any]], style: str) -> None:
    """The entries in order, the first SAME_CAUSE_SHOWN of each kind and site in full, then one
    line for the others of that kind and site, where the last one in full was."""
    total: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for f in entries:
        total.setdefault(_same_cause(f), []).append(f)
    seen: dict[tuple[Any, ...], int] = {}
    for f in entries:
        key = _same_cause(f)
        n = seen[key] = seen.get(key, 0) + 1
        if n > SAME_CAUSE_SHOWN:
            continue
        _finding(con, f, style)
        rest = total[key][SAME_CAUSE_SHOWN:]
        if n == SAME_CAUSE_SHOWN and rest:
            con.print(escape("      " + _more(rest)))


def _more(rest: list[dict[str, Any]]) -> str:
    """'... and 24 more kv_never_written at beam.py:30 serve_one: requests 'a', ... blocks ...'."""
    kind, site = rest[0]["kind"], rest[0].get("site")
    requests: list[str] = []
    for f in rest:
        if f.get("request") and f["request"] not in requests:
            requests.append(f["request"])
    blocks = sorted({b for f in rest for b in f.get("blocks") or ()})
    line = f"... and {len(rest)} more {kind}" + (f" allocated at {site}" if site else "")
    if requests:
        names = ", ".join(repr(r) for r in requests[:8])
        more = f" and {len(requests) - 8} more" if len(requests) > 8 else ""
        line += f": request(s) {names}{more}"
    if blocks:
        line += f"; {_blocks(blocks)}"
    return line + " (--request R shows one in full, --json lists every one)"


def _blocks(ids: list[int]) -> str:
    """'block 3' or 'blocks 0-6, 9' (ranges of consecutive ids)."""
    if len(ids) == 1:
        return f"block {ids[0]}"
    runs: list[str] = []
    ids = sorted(ids)
    start = prev = ids[0]
    for b in ids[1:] + [None]:
        if b is not None and b == prev + 1:
            prev = b
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if b is not None:
            start = prev = b
    return "blocks " + ", ".join(runs)


def _finding(con: Console, f: dict[str, Any], style: str) -> None:
    where = []
    if f.get("blocks"):
        where.append(_blocks(f["blocks"]))
    if f.get("owner_pid"):
        where.append(f"pid {f['owner_pid']}")
    if f.get("request"):
        where.append(f"request {f['request']!r}")
    src = " (recorded)" if f.get("source") == "recorded" else ""
    place = f" {escape(' '.join(where))}" if where else ""
    con.print(f"  [{style}]{f['kind']}[/{style}]{place}{src}: {escape(f['message'])}")
    if f.get("first_bad_event"):
        con.print(
            "      [bold]first bad event:[/bold] " + escape(_event_line(f["first_bad_event"]))
        )
    at = f" ({when_text(f['alloc_ns'])})" if f.get("alloc_ns") else ""
    sites = f.get("block_sites") or {}
    if len(sites) > 1:
        # (blocks of one request allocated at several lines: a shared prefix's, its own)
        each = [f"{site or 'a site not recorded'} ({_blocks(b)})" for site, b in sites.items()]
        con.print(escape("      allocated at " + "; ".join(each)))
    elif f.get("stack"):
        con.print(escape(f"      allocated at {f['stack'][0]}{at}"))
        for frame in f["stack"][1:]:
            con.print(escape(f"        called from {frame}"))
    elif f.get("site"):
        con.print(escape(f"      allocated at {f['site']}{at}"))
    elif f.get("alloc_ns"):
        con.print(
            escape(f"      allocated {when_text(f['alloc_ns'])} (allocation site not recorded)")
        )
    events = f.get("events") or []
    pid, whose = f.get("owner_pid"), ""
    if f["kind"] == "leak_dead_owner" and pid and any(e["pid"] == pid for e in events):
        # What the dead process did last with the block, not the hits and frees of the
        # survivors that share it (a prefix block's last events are theirs)
        others = sum(1 for e in events if e["pid"] != pid)
        if others:
            whose = f" of pid {pid} ({others} of other processes left out)"
        events = [e for e in events if e["pid"] == pid]
    if events:
        # The events that led to the finding: those up to the moment it was recorded (a
        # block's later life, other requests' hits and frees, says nothing of what went wrong)
        found = f.get("time_ns")
        upto = sum(1 for e in events if e["time_ns"] <= found) if found else len(events)
        if not upto or len(events) <= EVENTS_SHOWN:
            upto = len(events)
        shown = events[max(0, upto - EVENTS_SHOWN) : upto]
        later = len(events) - upto
        if found and not any(e["time_ns"] <= found for e in events):
            # (the ring has turned since: what it holds is the block's later life only)
            con.print(
                f"      no event up to the finding left in the flight recorder: the"
                f" {len(events)} it holds{whose} came after it (each process's ring keeps its"
                f" last PoolConfig(event_capacity=...) events; --json lists every one)"
            )
            shown = []
        elif len(shown) == len(events):
            con.print(f"      last events{whose}:")
        elif later:
            con.print(
                f"      the {len(shown)} events{whose} up to the finding, of its {len(events)}"
                f" recorded ({later} after it; --json lists every one):"
            )
        else:
            con.print(
                f"      last {len(shown)} of its {len(events)} recorded events{whose} (--json"
                " lists every one):"
            )
        for e in shown:
            con.print("        " + escape(_event_line(e)))
    if f.get("read_unwritten") and f["kind"] == "kv_never_written":
        # (a block published with positions nobody wrote: no later write to blame)
        names = ", ".join(repr(r) for r in f["read_unwritten"])
        con.print(
            escape(
                f"      published with those positions unwritten, and read by the prefix hits"
                f" of {names}: they read K/V nobody wrote"
            )
        )
    elif f.get("read_unwritten"):
        names = ", ".join(repr(r) for r in f["read_unwritten"])
        who = f" {f['request']!r}" if f.get("request") else ""
        con.print(
            escape(
                f"      read before its K/V was written by {names} (their prefix hits found it"
                f" still blank); its publisher{who} wrote it after mark_computed: publish"
                " positions only once their K/V is written"
            )
        )
    if f.get("mapped_since_published"):
        names = ", ".join(repr(r) for r in f["mapped_since_published"])
        con.print(
            escape(
                f"      mapped since its publication by {names} (the writer: one of them, or its publisher)"
            )
        )
    if f.get("intact_at") is not None:
        at = f["intact_at"]
        held = ", ".join(repr(r) for r in f.get("held_since_intact") or [])
        who = (
            f"written since by {held}, the request(s) holding it from then"
            if held
            else "held by no request since"
        )
        con.print(
            escape(
                f"      K/V intact at the {at['op'].replace('_', ' ')} of {at['request']!r} (pid"
                f" {at['pid']}, {when_text(at['time_ns'])}): {who} (or through a table or slot that"
                " does not map it)"
            )
        )


def _focus_value(k: str, v: Any) -> str:
    """One field of `--block` / `--request` as text: a time as a time, a list as its items."""
    if k.endswith("_ns") and isinstance(v, int) and v > 0:
        return when_text(v)
    if isinstance(v, list):
        return ", ".join(repr(x) if isinstance(x, str) else str(x) for x in v) or "none"
    return repr(v) if k == "request" and isinstance(v, str) else str(v)


# `--request R`'s fields in words (the JSON keeps the keys).
_FOCUS_LABELS = {"blocks_stamped": "blocks allocated in its name"}


def _focus(con: Console, key: str, d: dict[str, Any]) -> None:
    con.print(f"\n[bold]{key} {escape(str(d.get(key)))}[/bold]")
    for k, v in d.items():
        if k in (key, "events", "num_blocks_stamped"):
            continue
        if k == "blocks_stamped" and d.get("num_blocks_stamped", 0) > len(v):
            v = [*v, f"... ({d['num_blocks_stamped']} in all)"]
        if k == "sequences":
            for q in v:
                table = ", ".join(map(str, q.get("block_table") or [])) or "none"
                con.print(
                    escape(
                        f"  sequence: {q.get('state')}, pid {q.get('owner_pid')},"
                        f" {q.get('num_tokens')} tokens, blocks {table}"
                    )
                )
            if not v:
                con.print("  sequences: none")
            continue
        con.print(escape(f"  {_FOCUS_LABELS.get(k, k)}: {_focus_value(k, v)}"))
    events = d.get("events") or []
    if key == "request":
        con.print(
            f"  its recorded events ({len(events)}, oldest first):" if events else
            "  its recorded events: none left in the flight recorder"
        )  # fmt: skip
    for e in events:
        con.print("    " + escape(_event_line(e, with_block=key == "request")))


def _summary(con: Console, s: dict[str, Any]) -> None:
    if not s:
        return
    con.print("\n[bold]blocks by state[/bold]")
    con.print(
        "  " + ", ".join(f"{k} {v}" for k, v in s["blocks_by_state"].items()),
    )
    con.print(
        f"  utilization {s['utilization']:.1%}, prefix hit rate {s['prefix_hit_rate']:.1%};"
        f" sequences: "
        + (", ".join(f"{k} {v}" for k, v in s["sequences_by_state"].items() if v) or "none")
    )
    _leases(con, s.get("leases") or {})
    if s["blocks_by_owner"]:
        from rich.table import Table

        t = Table(title=None, box=None, pad_edge=False, show_edge=False)
        rows = s["blocks_by_owner"][:20]
        # blocks a process allocated that only other processes' requests map now (a shared
        # prefix outliving its first request): held, but not that process's to free
        others = any(o.get("held_for_others") for o in rows)
        # free blocks parked in a process's local cache: its own, not held by any request
        local = any(o.get("local") for o in rows)
        cols: tuple[str, ...] = ("owner pid", "process", "blocks held", "requests")
        cols += ("of them mapped only by others",) if others else ()
        for col in cols + (("free in its local cache",) if local else ()):
            t.add_column(col, justify="right" if col != "process" else "left")
        for o in rows:
            state = {True: "alive", False: "dead", None: "detached"}[o["alive"]]
            state += " (stopped)" if o.get("stopped") else ""
            parked = int(o.get("local", 0))
            row = [str(o["pid"]), state, str(o["blocks"] - parked), str(o["requests"])]
            row += [str(o.get("held_for_others", 0))] if others else []
            t.add_row(*row, *([str(parked)] if local else []))
        con.print("\n[bold]blocks by owner[/bold]")
        con.print(t)


def _leases(con: Console, ls: dict[str, Any]) -> None:
    """The lease section: held now (each with its holder, mode, request and blocks), and the
    counts since the pool was created; nothing when no lease was ever taken."""
    if not ls.get("taken"):
        return
    con.print("\n[bold]leases[/bold]")
    con.print(
        escape(
            f"  held {ls['held']} (quarantining {ls['quarantined']} freed block(s)); since"
            f" creation taken {ls['taken']}, released {ls['released']}, late writes"
            f" {ls['late']}, leaked {ls['leaked']}, reclaimed {ls['reclaimed']}"
        )
    )
    for row in ls.get("list") or []:
        leak = ", leaked" if row["leaked"] else ""
        con.print(
            escape(
                f"  {row['mode']} lease {row['id']} holder {row['holder']!r} pid {row['pid']}"
                f" request {row['request']!r}: {_blocks(row['blocks'])}{leak}"
            )
        )


def _capacity(con: Console, c: dict[str, Any]) -> None:
    """The capacity answer (kvscope.capacity): one sentence, then peak and mean demand."""
    con.print("\n[bold]capacity[/bold]")
    con.print("  " + escape(c["answer"]))
    if c.get("source") == "history":
        con.print(
            escape(
                f"  peak demand {c['peak_demand']}, mean {c['mean_demand']} of {c['num_blocks']}"
                f" blocks over {c['span_s']:.1f} s ({c['num_samples']} samples);"
                f" preemptions {c['num_preemptions']}, evictions {c['num_evictions']}"
                + (f", PoolExhausted {c['num_exhausted']}" if c.get("num_exhausted") else "")
            )
        )
