"""A recorded KV-event stream as one self-contained HTML file (`kvscope report FILE`).

    page = build_stream_report(walk_file("engine.kvev"))

Inline SVG and CSS, no script, as a pool's report (kvscope/htmlreport.py's style, the charts
of kvscope/charts.py): health and the stream's origin; the accounting per publisher; per
publisher over time, the cache's block copies and distinct hashes, stores and removals per
second, new hashes against hashes stored again (a prefix hit re-reported or another copy); the
stores and removals per hash (the most stored, how long hashes stayed); the prefix tree per
(publisher, medium, group); every finding with the events that led to it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from kvscope import __version__
from kvscope.allocator.dumpfile import write_atomic
from kvscope.charts import esc, histogram, line_chart
from kvscope.errors import EXIT_OK, UsageError
from kvscope.events.walk import Series, StreamWalk, Walked, walk_file
from kvscope.events.wire import hash_text
from kvscope.htmlreport import CSS
from kvscope.report import when_text

EXTRA_CSS = """
ul.tree { list-style: none; padding-left: 18px; margin: 2px 0; }
ul.tree li { font: 12px ui-monospace, monospace; }
.gone { color: #888; }
"""
# The prefix tree: roots drawn per cache, children per node, and lines in all.
MAX_ROOTS = 8
MAX_CHILDREN = 6
MAX_TREE_LINES = 200
# Hashes listed by how often they were stored.
TOP_HASHES = 15
# Rates over time: at most this many intervals.
RATE_BINS = 100
HASH_CHARS = 16


def _h(h: Any) -> str:
    text = hash_text(h)
    if len(text) <= HASH_CHARS:
        return f"<code>{esc(text)}</code>"
    return f'<code title="{esc(text)}">{esc(text[:HASH_CHARS])}…</code>'


def _table(head: list[str], rows: list[list[Any]], numeric: set[int] | None = None) -> str:
    numeric = numeric or set()
    th = "".join(f"<th>{esc(h)}</th>" for h in head)
    body = "".join(
        "<tr>"
        + "".join(
            f"<td class=n>{esc(v)}</td>" if i in numeric else f"<td>{v}</td>"
            for i, v in enumerate(r)
        )
        + "</tr>"
        for r in rows
    )
    return f"<table><tr>{th}</tr>{body}</table>"


def _header(walked: Walked) -> str:
    rep = walked.report
    found = rep["findings"]
    counts = rep["summary"]["findings_by_kind"]
    total = sum(counts.values())
    errors = sum(f["severity"] == "error" for f in found)
    if not rep["healthy"]:
        health = f'<span class="bad">UNHEALTHY: {total} finding(s), {errors} error(s) shown</span>'
    elif total:
        health = f'<span class="warn">HEALTHY with {total} warning(s)</span>'
    else:
        health = '<span class="ok">HEALTHY, no findings</span>'
    head = walked.header
    eps = ", ".join(head.get("endpoints") or []) or "?"
    replay = ", ".join(head.get("replay") or [])
    return (
        f"<h1>kvscope report: KV-event stream {esc(os.path.basename(walked.path))}</h1>"
        f'<p class="sub">{esc(walked.path)} &middot; recorded from {esc(eps)}'
        + (f" (replay {esc(replay)})" if replay else "")
        + f" &middot; started {esc(when_text(int(head.get('created_ns') or 0)))}</p>"
        f"<p><b>health:</b> {health}</p>"
    )


def _summary(walked: Walked) -> str:
    s = walked.report["summary"]
    rows = [
        [esc(k), v]
        for k, v in (
            ("records", s["records"]),
            ("publishers", s["publishers"]),
            ("batches", s["batches"]),
            ("events", s["events"]),
            ("hashes stored", s["stored"]),
            ("hashes removed", s["removed"]),
            ("AllBlocksCleared", s["cleared"]),
            ("gaps (batches lost)", f"{s['gaps']} ({s['missing_batches']})"),
            ("restarts", s["resets"]),
            ("reordered", s["reordered"]),
            ("replayed", s["replayed"]),
            ("not verifiable", s["unverifiable"]),
            ("malformed", s["malformed"]),
        )
    ]
    cut = (
        "<p class=warn>The file ends inside a record: it was cut short (the recorder killed?),"
        f" read up to its last whole record; {s.get('unread_bytes', 0):,} byte(s) unread in"
        " all.</p>"
        if s["truncated"]
        else ""
    )
    pubs = [
        [
            esc(p["endpoint"] + (f" topic {p['topic']!r}" if p["topic"] else "")),
            esc("-" if p["rank"] is None else p["rank"]),
            esc(
                "two interleaved" if p.get("interleaved") else f"{p['first_seq']}..{p['last_seq']}"
            ),
            esc(f"{p['batches']:,}"),
            esc(f"{p['events']:,}"),
            esc(f"{p['blocks_stored']:,}"),
            esc(f"{p['peak_blocks_stored']:,}"),
            esc(f"{p['gaps']} ({p['missing_batches']})"),
            esc(p["resets"]),
            esc("yes" if p["complete"] else f"no: {p['incomplete_because']}"),
        ]
        for p in walked.report["publishers"]
    ]
    return (
        "<h2>Stream</h2>"
        + _table(["", ""], rows)
        + cut
        + "<h2>Publishers</h2>"
        + _table(
            [
                "publisher",
                "rank",
                "seq",
                "batches",
                "events",
                "stored now",
                "peak",
                "gaps (lost)",
                "restarts",
                "verifiable in full",
            ],
            pubs,
        )
        + "<p class=sub>Stored: block copies (a hash counts once per copy stored).</p>"
    )


def _rates(s: Series, t0: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seconds, stored/s, removed/s) over up to RATE_BINS equal intervals."""
    t = np.asarray(s.time_ns, np.int64)
    order = np.argsort(t, kind="stable")
    t = t[order]
    stored = np.asarray(s.stored, np.int64)[order]
    removed = np.asarray(s.removed, np.int64)[order]
    lo, hi = int(t[0]), int(t[-1])
    if hi <= lo:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    edges = np.linspace(lo, hi, min(RATE_BINS, len(t)) + 1)
    idx = np.searchsorted(t, edges, side="right") - 1
    width = (edges[1] - edges[0]) / 1e9

    def per_s(cum: np.ndarray) -> np.ndarray:
        at = np.where(idx >= 0, cum[np.maximum(idx, 0)], 0)
        return np.diff(at) / width

    return (edges[1:] - t0) / 1e9, per_s(stored), per_s(removed)


def _over_time(walk: StreamWalk) -> str:
    parts = ["<h2>Over time</h2>"]
    t0 = walk.first_ns
    for key, s in walk.series.items():
        if len(s.time_ns) < 2:
            parts.append(f"<p>{esc(walk.publisher_name(key))}: one batch, nothing to draw.</p>")
            continue
        t = (np.asarray(s.time_ns, np.int64) - t0) / 1e9
        rt, st, rm = _rates(s, t0)
        parts.append(f"<h3>{esc(walk.publisher_name(key))}</h3>")
        parts.append(
            line_chart(
                t,
                [
                    ("block copies stored (peak per sample)", np.asarray(s.peak), "#2166ac"),
                    ("distinct hashes stored", np.asarray(s.hashes), "#2e7d32"),
                ],
                y_label="cache size",
            )
        )
        if len(rt):
            parts.append(
                line_chart(
                    rt,
                    [("stored / s", st, "#2e7d32"), ("removed / s", rm, "#ef6c00")],
                    y_label="hashes per second",
                )
            )
        parts.append(
            line_chart(
                t,
                [
                    ("new hashes stored (miss: computed)", np.asarray(s.new), "#6a3d9a"),
                    ("stored again (hit re-reported, or a copy)", np.asarray(s.again), "#4292c6"),
                ],
                y_label="stores (total)",
            )
        )
    parts.append(
        "<p class=sub>Time: the publisher's batch timestamps. A store of a hash already stored"
        ' is a prefix hit re-reported (vLLM\'s "full" report mode) or another physical copy;'
        " the stream does not tell the two apart.</p>"
    )
    return "".join(parts)


def _buckets(values: list[float]) -> tuple[list[str], list[int]]:
    """Stays by duration: < 1 ms, < 10 ms, ... powers of ten, and still stored."""
    edges = [1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0]
    names = ["<1ms", "<10ms", "<100ms", "<1s", "<10s", "<100s", "<1000s", "longer"]
    counts = [0] * len(names)
    for v in values:
        counts[next((i for i, e in enumerate(edges) if v < e), len(edges))] += 1
    while len(counts) > 1 and not counts[-1]:
        counts.pop()
        names.pop()
    return names, counts


def _per_hash(walk: StreamWalk) -> str:
    stores: dict[tuple[Any, ...], list[Any]] = {}
    for life in walk.lives:
        k = (life.pub, life.cache, life.hash)
        got = stores.setdefault(k, [0, 0, 0, 0.0])
        got[0] += 1 + life.stored_again
        got[1] += 1
        got[2] += life.end == "removed"
        got[3] += ((life.end_ns if life.end_ns is not None else walk.last_ns) - life.start_ns) / 1e9
    done = [(life.end_ns - life.start_ns) / 1e9 for life in walk.lives if life.end_ns is not None]
    still = sum(life.end_ns is None for life in walk.lives)
    top = sorted(stores.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))[:TOP_HASHES]
    rows = [
        [_h(k[2]), esc(walk.publisher_name(k[0])), v[0], v[1], v[2], f"{v[3]:.3f}"] for k, v in top
    ]
    omitted = (
        f"<p class=warn>{walk.lives_omitted:,} more stays not kept (at most {len(walk.lives):,}).</p>"
        if walk.lives_omitted
        else ""
    )
    if not walk.lives:
        return "<h2>Stores and removals per hash</h2><p>No block stored.</p>"
    return (
        "<h2>Stores and removals per hash</h2>"
        f"<p>{len(stores):,} hash(es) in {len(walk.lives):,} stay(s) (a stay: from a store that"
        " found no copy to the removal of its last copy, a clear or a restart);"
        f" {still:,} still stored at the end.</p>"
        + omitted
        + _table(
            ["hash", "publisher", "stores", "stays", "removed", "seconds stored"],
            rows,
            {2, 3, 4, 5},
        )
        + histogram(
            *_buckets(done),
            colour="#4292c6",
            x_label="stays that ended, by how long the hash stayed",
        )
    )


def _tree(walk: StreamWalk) -> str:
    parts = ["<h2>Prefix tree</h2>"]
    if not walk.parents:
        return parts[0] + "<p>No block stored.</p>"
    for (key, ck), parents in walk.parents.items():
        pub = walk.publishers.get(key)
        cache = pub.caches.get(ck) if pub is not None else None
        live = cache.copies if cache is not None else {}
        children: dict[Any, list[Any]] = {}
        roots = []
        for h, p in parents.items():
            if p is None or p not in parents:
                roots.append(h)
            else:
                children.setdefault(p, []).append(h)
        size: dict[Any, int] = {}
        depth = 0
        # sizes bottom-up: an explicit stack (chains are as deep as prompts are long)
        for r in roots:
            stack = [(r, 1, False)]
            while stack:
                h, d, done = stack.pop()
                if done:
                    size[h] = 1 + sum(size[c] for c in children.get(h, ()))
                    continue
                depth = max(depth, d)
                stack.append((h, d, True))
                stack.extend((c, d + 1, False) for c in children.get(h, ()) if c not in size)
        medium, group = ck
        where = walk.publisher_name(key) + "".join(
            f", {n} {v}" for n, v in (("medium", medium), ("group", group)) if v is not None
        )
        unattached = sum(1 for r in roots if parents[r] is not None)
        parts.append(
            f"<h3>{esc(where)}</h3><p>{len(parents):,} hash(es) ever stored, {len(roots):,}"
            f" root(s) ({unattached:,} under a parent never seen stored), depth up to"
            f" {depth:,} blocks; {len(live):,} stored now.</p>"
        )
        lines = [0]
        roots.sort(key=lambda r: -size.get(r, 1))
        parts.append(
            '<ul class="tree">'
            + "".join(_node(r, children, size, live, lines) for r in roots[:MAX_ROOTS])
            + (
                f"<li>… {len(roots) - MAX_ROOTS:,} more root(s)</li>"
                if len(roots) > MAX_ROOTS
                else ""
            )
            + "</ul>"
        )
    if walk.tree_omitted:
        parts.append(f"<p class=warn>{walk.tree_omitted:,} more hashes not kept in the tree.</p>")
    parts.append(
        "<p class=sub>Each line: a hash, or a chain of hashes each the only child of the one"
        " before; grey: not stored at the end of the stream. Branches are ordered by size.</p>"
    )
    return "".join(parts)


def _node(h: Any, children, size, live, lines: list[int]) -> str:
    if lines[0] >= MAX_TREE_LINES:
        return ""
    lines[0] += 1
    chain = [h]
    while len(children.get(chain[-1], ())) == 1:
        chain.append(children[chain[-1]][0])
    last = chain[-1]
    stored = sum(1 for c in chain if live.get(c))
    text = _h(h) if len(chain) == 1 else f"{_h(h)} → … → {_h(last)} ({len(chain)} blocks)"
    state = (f", {live[h]} copies stored" if len(chain) == 1 and live.get(h, 0) > 1 else "") or (
        f", {stored} of {len(chain)} stored" if len(chain) > 1 and stored else ""
    )
    cls = "" if stored else ' class="gone"'
    kids = sorted(children.get(last, ()), key=lambda c: -size.get(c, 1))
    sub = "".join(_node(c, children, size, live, lines) for c in kids[:MAX_CHILDREN])
    if len(kids) > MAX_CHILDREN:
        sub += f"<li>… {len(kids) - MAX_CHILDREN} more branch(es)</li>"
    more = f" ({size.get(h, 1):,} hashes in this branch)" if kids else ""
    return (
        f"<li{cls}>{text}{esc(state)}{esc(more)}"
        + (f'<ul class="tree">{sub}</ul>' if sub else "")
        + "</li>"
    )


def _findings(walked: Walked) -> str:
    found = walked.report["findings"]
    counts = walked.report["summary"]["findings_by_kind"]
    total = sum(counts.values())
    if not total:
        return "<h2>Findings</h2><p class=ok>none</p>"
    out = [f"<h2>Findings ({total})</h2>"]
    for f in found:
        x = f.get("extra") or {}
        rows = [
            [
                esc(e["batch"]),
                esc(e["seq"]),
                esc(e["type"]),
                _h(e["hash"]) if "hash" in e else "",
                _h(e["parent"]) if "parent" in e else "",
                esc(e.get("what") or ""),
            ]
            for e in f["events"]
        ]
        where = ", ".join(
            f"{k} {x[k]}" for k in ("publisher", "medium", "group", "hash") if x.get(k) is not None
        )
        out.append(
            f'<div class="finding {esc(f["severity"])}"><b>{esc(f["kind"])}</b>'
            f" ({esc(f['severity'])}): {esc(f['message'])}"
            + (f"<p class=sub>{esc(where)}</p>" if where else "")
            + (_table(["batch", "seq", "event", "hash", "parent", ""], rows) if rows else "")
            + "</div>"
        )
    if total > len(found):
        out.append(
            f"<p>{total - len(found)} more finding(s) counted, not listed: {esc(counts)}</p>"
        )
    return "".join(out)


def build_stream_report(walked: Walked) -> str:
    """The whole page as one string."""
    body = "".join(
        [
            _header(walked),
            _summary(walked),
            _over_time(walked.walk),
            _per_hash(walked.walk),
            _tree(walked.walk),
            _findings(walked),
            f'<p class="sub">kvscope {esc(__version__)}. This file needs no network and runs'
            " no script.</p>",
        ]
    )
    title = f"kvscope report: {os.path.basename(walked.path)}"
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<link rel="icon" href="data:,">'
        f"<title>{esc(title)}</title><style>{CSS}{EXTRA_CSS}</style></head><body>{body}"
        "</body></html>\n"
    )


def report_verb(target: str, output: str, history: str | None) -> int:
    """`kvscope report FILE -o OUT` of a recorded stream (the verb checked OUT already)."""
    if history is not None:
        raise UsageError("--history is a pool's; a recorded event stream carries its own times")
    walked = walk_file(target)
    page = build_stream_report(walked)
    write_atomic(output, [page.encode()], mode=None)
    size = os.path.getsize(output)
    total = sum(walked.report["summary"]["findings_by_kind"].values())
    print(
        f"kvscope: wrote {os.path.abspath(output)} ({size / 1024:.0f} KiB,"
        f" {walked.report['summary']['batches']:,} batch(es), {total} finding(s))",
        file=sys.stderr,
    )
    return EXIT_OK
