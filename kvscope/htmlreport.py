"""`kvscope report`: one self-contained HTML file about a pool or a dump (inline SVG and CSS, no
script, no network): the block map, the pool over time, the capacity answer, sharing and reuse,
and every finding with its allocation and release history and stack.

    page = build_report(view, analysis=analyze_view(view), history=h, capacity=c, source="...")
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvscope import __version__
from kvscope.allocator.layout import BlockState, SegmentView
from kvscope.charts import block_map, esc, histogram, legend, line_chart
from kvscope.history import History
from kvscope.report import counted, grouped, when_text

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 980px;
  color: #222; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px;
  border-bottom: 1px solid #ddd; padding-bottom: 3px; }
.sub { color: #666; } .ok { color: #1a7f37; } .bad { color: #c62828; } .warn { color: #9a6700; }
table { border-collapse: collapse; margin: 6px 0; } td, th { padding: 2px 10px 2px 0;
  text-align: left; vertical-align: top; } th { font-weight: 600; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.legend { list-style: none; padding: 0; display: flex; flex-wrap: wrap; gap: 4px 18px; }
.sw { display: inline-block; width: 11px; height: 11px; margin-right: 2px;
  vertical-align: -1px; box-sizing: border-box; }
.key { margin-right: 16px; } figure { margin: 8px 0 16px; } figcaption { font-size: 12px; }
.tick { font-size: 10px; fill: #555; } .axis { font-size: 11px; fill: #333; }
.answer { font-size: 15px; background: #f4f6f8; padding: 8px 12px; border-left: 4px solid #4292c6; }
.finding { border: 1px solid #e0e0e0; border-left: 4px solid #c62828; padding: 6px 12px;
  margin: 10px 0; } .finding.warning { border-left-color: #d29922; }
code, pre { font: 12px ui-monospace, monospace; } pre { margin: 2px 0; white-space: pre-wrap; }
.hists { display: flex; flex-wrap: wrap; gap: 12px; }
"""
COLOURS = {"allocated": "#2e7d32", "cached": "#2166ac", "free": "#9e9e9e", "local": "#00838f"}


def _table(rows: list[tuple[str, Any]]) -> str:
    cells = "".join(
        f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows if v is not None
    )
    return f"<table>{cells}</table>"


def _header(analysis: dict[str, Any], source: str) -> str:
    pool = analysis["pool"]
    g = pool["geometry"]
    found = analysis["findings"]
    # (counted as `kvscope analyze` counts them: those the check counted past its cap too)
    errors = counted([f for f in found if f["severity"] == "error"])
    warnings = counted([f for f in found if f["severity"] != "error"])
    if errors:
        health = f'<span class="bad">UNHEALTHY: {errors} error(s), {warnings} warning(s)</span>'
    elif found:
        health = f'<span class="warn">OK with {warnings} warning(s)</span>'
    else:
        health = '<span class="ok">OK, no findings</span>'
    probes = ", ".join(f"{k} {'on' if v else 'off'}" for k, v in pool["flags"].items())
    dump = pool.get("dump")
    origin = (
        f"dump written {when_text(dump['created_ns'])} about pid {dump['pid']} on {dump['host']}"
        + (f": {dump['reason']}" if dump.get("reason") else "")
        if dump
        else "live pool"
    )
    # (what analyze's text says of the K/V data checks that did not run)
    data = analysis.get("data_checks")
    note = (
        f'<p class="sub">note: {esc(data["unchecked"])}</p>' if data and not data["checked"] else ""
    )
    return (
        f"<h1>kvscope report: pool {esc(pool['name'])}</h1>"
        f'<p class="sub">{esc(source)} &middot; {esc(origin)}<br>'
        f"{g['num_blocks']:,} blocks x {g['block_size']} tokens, {g['num_layers']}"
        f" layer{'' if g['num_layers'] == 1 else 's'},"
        f" {g['num_kv_heads']} kv heads x {g['head_dim']}, {esc(g['dtype'])} on"
        f" {esc(pool['device'])}; probes: {esc(probes)}</p>{note}<p><b>health:</b> {health}</p>"
    )


def _blocks(view: SegmentView, analysis: dict[str, Any]) -> str:
    b = view.blocks
    n = len(b)
    marked = np.zeros(n, bool)
    ids = [f["block"] for f in analysis["findings"] if f.get("block") is not None]
    ids = [i for i in ids if 0 <= i < n]
    marked[ids] = True
    svg, group = block_map(b["state"], b["refcount"], marked)
    s = analysis.get("summary") or {}
    counts = ", ".join(f"{k} {v:,}" for k, v in (s.get("blocks_by_state") or {}).items())
    if s:
        counts += (
            f"; utilization {s['utilization']:.1%}, prefix hit rate {s['prefix_hit_rate']:.1%}"
        )
    scale = "one cell per block" if group == 1 else f"one cell per {group} blocks"
    return (
        f"<h2>Block map</h2><p>{scale}; {esc(counts)}</p>{svg}{legend()}"
        "<p class=sub>A cell of several blocks shows the state most of its blocks in use are"
        " in, shaded by the highest refcount among them.</p>"
    )


def _over_time(history: History | None, n: int) -> str:
    if history is None or history.count < 2:
        return (
            "<h2>Over time</h2><p>No recorded history: `kvscope run` samples the pool while the"
            " script runs and writes it beside its dump (`.history.json`).</p>"
        )
    s = history.samples
    t = (s["time_ns"] - s["time_ns"][0]) / 1e9
    util = 100 * s["num_allocated"] / max(1, n)
    charts = [
        line_chart(t, [("utilization %", util, COLOURS["allocated"])], y_label="% of blocks"),
        line_chart(
            t,
            [
                ("held (allocated)", s["num_allocated"], COLOURS["allocated"]),
                ("cached", s["num_cached"], COLOURS["cached"]),
                ("free", s["num_free"] + s["num_quarantined"], COLOURS["free"]),
                ("local caches", s["num_local"], COLOURS["local"]),
            ],
            y_label="blocks",
            hline=("pool size", float(n)),
        ),
        line_chart(
            t,
            [
                ("demand (held + wanted back by preempted)", s["demand_max"], "#6a3d9a"),
                ("held", s["allocated_max"], COLOURS["allocated"]),
            ],
            y_label="blocks",
            hline=("pool size", float(n)),
        ),
        line_chart(
            t,
            [
                ("preemptions (total)", s["num_preemptions"], "#c62828"),
                ("evictions (total)", s["num_evictions"], "#ef6c00"),
            ],
            y_label="count",
        ),
    ]
    return (
        f"<h2>Over time</h2><p>{history.count} samples over {float(t[-1]):.1f} s"
        f" (every {history.interval_s:g} s or less; peaks between two merged samples are"
        " kept).</p>" + "".join(charts)
    )


def _last_exhausted(last: dict[str, int] | None) -> str | None:
    """The last PoolExhausted's figures (kvscope.capacity), one cell."""
    if not last:
        return None
    return (
        f"pid {last['pid']} needed {last['needed']:,} block{'' if last['needed'] == 1 else 's'}:"
        f" {last['free_list']:,} free in the shared"
        f" free list, {last['own_cache']:,} in its own local cache, {last['other_caches']:,} in"
        " other processes' local caches"
    )


def _capacity(cap: dict[str, Any]) -> str:
    rows = [
        ("pool size", f"{cap['num_blocks']:,} blocks"),
        ("peak demand", cap.get("peak_demand")),
        ("mean demand (time-weighted)", cap.get("mean_demand")),
        ("peak / mean", cap.get("peak_to_mean")),
        ("peak held", cap.get("peak_held")),
        ("preemptions", cap.get("num_preemptions")),
        ("evictions", cap.get("num_evictions")),
        ("PoolExhausted raised", cap.get("num_exhausted")),
        ("last PoolExhausted", _last_exhausted(cap.get("last_exhausted"))),
        ("pool size without preemption", cap.get("pool_size_without_preemption")),
        ("demand now", cap.get("demand_now")),
    ]
    return (
        f'<h2>Capacity</h2><p class="answer">{esc(cap["answer"])}</p>{_table(rows)}'
        "<p class=sub>Demand: blocks held by sequences plus the blocks preempted sequences"
        " needed back. With several processes, each also keeps up to `local_cache_size` free"
        " blocks in its own cache on top.</p>"
    )


def _leases(analysis: dict[str, Any]) -> str:
    """The lease section (allocator/lease.py): its counts and the leases held; nothing when the
    pool never had one."""
    ls = (analysis.get("summary") or {}).get("leases") or {}
    if not ls.get("taken"):
        return ""
    rows = [
        ("held now", ls["held"]),
        ("freed blocks they quarantine", ls["quarantined"]),
        ("taken", ls["taken"]),
        ("released", ls["released"]),
        ("late writes (transfer_after_free)", ls["late"]),
        ("leaked (lease_leak)", ls["leaked"]),
        ("reclaimed", ls["reclaimed"]),
    ]
    held = "".join(
        f"<tr><td>{r['id']}</td><td>{esc(r['mode'])}</td><td>{esc(r['holder'])}</td>"
        f"<td>{r['pid']}</td><td>{esc(r['request'])}</td>"
        f"<td>{esc(', '.join(map(str, r['blocks'][:32])))}</td>"
        f"<td>{'leaked' if r['leaked'] else ''}</td></tr>"
        for r in ls.get("list") or []
    )
    table = (
        "<table><tr><th>lease</th><th>mode</th><th>holder</th><th>pid</th><th>request</th>"
        f"<th>blocks</th><th></th></tr>{held}</table>"
        if held
        else ""
    )
    return f"<h2>Leases</h2>{_table(rows)}{table}"


def _buckets(values: np.ndarray) -> tuple[list[str], list[int]]:
    """Counts of 0, 1, 2, 3-4, 5-8, ... (powers of two)."""
    labels, counts = [], []
    edges = [0, 1, 2, 3]
    while edges[-1] <= max(3, int(values.max(initial=0))):
        edges.append(edges[-1] * 2 - 1)
    for lo, hi in zip(edges[:-1], edges[1:]):
        c = int(((values >= lo) & (values < hi)).sum())
        labels.append(str(lo) if hi == lo + 1 else f"{lo}-{hi - 1}")
        counts.append(c)
    return labels, counts


def _sharing(view: SegmentView, history: History | None) -> str:
    b = view.blocks
    used = b["state"] != BlockState.FREE
    rc = b["refcount"][used].astype(np.int64)
    labels, counts = _buckets(rc)
    parts = [
        histogram(labels, counts, colour="#4292c6", x_label="blocks in use by refcount (now)"),
        histogram(
            *_buckets(b["generation"].astype(np.int64)),
            colour="#41a441",
            x_label="blocks by times allocated (reuse)",
        ),
    ]
    if history is not None and history.count:
        peaks = history.samples["refcount_peak_max"].astype(np.int64)
        parts.append(
            histogram(
                *_buckets(peaks),
                colour="#6a3d9a",
                x_label="samples by the pool's refcount peak",
            )
        )
    return (
        "<h2>Sharing and reuse</h2><p>Refcount: how many sequences share a block (prefix"
        " sharing, forks). Times allocated: each block's generation, +1 at every"
        f' allocation.</p><div class="hists">{"".join(parts)}</div>'
    )


def _event_rows(events: list[dict[str, Any]]) -> str:
    rows = "".join(
        f"<tr><td>{esc(when_text(e['time_ns']))}</td><td>pid {e['pid']}</td><td>{esc(e['op'])}</td>"
        f"<td class=n>gen {e['generation']}</td><td>{esc(e.get('request') or '')}</td></tr>"
        for e in events
    )
    return f"<table>{rows}</table>" if rows else "<p class=sub>no events recorded</p>"


def _finding(f: dict[str, Any]) -> str:
    blocks = f.get("blocks") or []
    where = ", ".join(map(str, blocks[:32])) + (
        f" (+{len(blocks) - 32})" if len(blocks) > 32 else ""
    )
    events = f.get("events") or []
    alloc = [e for e in events if e["op"] in ("allocate", "prefix_hit", "fork")]
    freed = [e for e in events if e["op"] in ("free", "abort", "preempt", "evict", "reclaim")]
    stack = f.get("stack") or ([f["site"]] if f.get("site") else [])
    sites = f.get("block_sites") or {}
    if len(sites) > 1:  # (blocks of one request allocated at several lines: report.grouped)
        stack = [
            f"{site or 'a site not recorded'} (blocks {', '.join(map(str, b))})"
            for site, b in sites.items()
        ]
    stack_html = (
        "".join(
            f"<pre>{'at' if k == 0 or len(sites) > 1 else '  called from'} {esc(fr)}</pre>"
            for k, fr in enumerate(stack)
        )
        or "<p class=sub>allocation site not recorded (KVSCOPE_OWNERSHIP=1; KVSCOPE_STACK_DEPTH=N for N frames)</p>"
    )
    rows = [
        ("blocks", where or None),
        ("owner pid", f.get("owner_pid")),
        ("request", f.get("request")),
        ("allocated", when_text(f["alloc_ns"]) if f.get("alloc_ns") else None),
        ("source", f.get("source")),
        (
            "read before its K/V was written by",
            ", ".join(map(repr, f["read_unwritten"])) + " (their prefix hits found it still blank)"
            if f.get("read_unwritten")
            else None,
        ),
        (
            "mapped since its publication by",
            ", ".join(map(repr, f["mapped_since_published"]))
            + " (the writer: one of them, or its publisher)"
            if f.get("mapped_since_published")
            else None,
        ),
        (
            "written after its last intact check",
            f"{f['intact_at']['op'].replace('_', ' ')} of {f['intact_at']['request']!r} (pid"
            f" {f['intact_at']['pid']}, {when_text(f['intact_at']['time_ns'])}); held since by "
            + (", ".join(map(repr, f.get("held_since_intact") or [])) or "no request")
            if f.get("intact_at")
            else None,
        ),
    ]
    bad = f.get("first_bad_event")
    return (
        f'<div class="finding {esc(f["severity"])}"><b>{esc(f["kind"])}</b> ({esc(f["severity"])}):'
        f" {esc(f['message'])}"
        + (f"<b>first bad event</b>{_event_rows([bad])}" if bad else "")
        + f"{_table(rows)}"
        f"<b>allocated by</b>{stack_html}{_event_rows(alloc)}"
        f"<b>freed by</b>{_event_rows(freed)}"
        f"<details><summary>every recorded event of block {blocks[0] if blocks else '-'}"
        f" ({len(events)})</summary>{_event_rows(events)}</details></div>"
    )


def _findings(analysis: dict[str, Any]) -> str:
    found = grouped(analysis["findings"])
    if not found:
        return "<h2>Findings</h2><p class=ok>none</p>"
    causes = "".join(
        f"<p><b>likely cause:</b> {esc(c)}</p>" for c in analysis.get("likely_causes", ())
    )
    return f"<h2>Findings ({len(analysis['findings'])})</h2>{causes}" + "".join(
        map(_finding, found)
    )


def build_report(
    view: SegmentView,
    *,
    analysis: dict[str, Any],
    history: History | None,
    capacity: dict[str, Any],
    source: str,
) -> str:
    """The whole page as one string."""
    n = int(view.h["num_blocks"])
    body = "".join(
        [
            _header(analysis, source),
            _capacity(capacity),
            _blocks(view, analysis),
            _over_time(history, n),
            _sharing(view, history),
            _leases(analysis),
            _findings(analysis),
            f'<p class="sub">kvscope {esc(__version__)}, {esc(when_text(_now_ns()))}.'
            " This file needs no network and runs no script.</p>",
        ]
    )
    title = f"kvscope report: {analysis['pool']['name']}"
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<link rel="icon" href="data:,">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>{body}</body></html>\n"
    )


def _now_ns() -> int:
    import time

    return time.time_ns()
