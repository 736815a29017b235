"""Inline SVG for the HTML report: the block map, line charts and histograms (no scripts).

Every function returns one `<svg>` element as text; hovering a mark shows its `<title>`.
"""

from __future__ import annotations

import html

import numpy as np

from kvscope.allocator.layout import BlockState

# Fill per state, then lighter to darker for refcount 1, 2, 3, 4+ (free has one shade).
STATE_FILLS = {
    BlockState.FREE: ("#e3e3e3",) * 4,
    BlockState.ALLOCATED: ("#7fc97f", "#41a441", "#1f7a1f", "#0b4d0b"),
    BlockState.CACHED: ("#9ecae1", "#4292c6", "#2166ac", "#08306b"),
    BlockState.LOCAL: ("#8de0e0",) * 4,
    BlockState.QUARANTINED: ("#d98bd9",) * 4,
}
INVALID_FILL = "#000000"
FINDING_STROKE = "#d62728"
# At most this many cells in the block map; bigger pools show groups of blocks per cell.
MAX_CELLS = 2048
COLUMNS = 64


def esc(text: object) -> str:
    """HTML-escaped text."""
    return html.escape(str(text), quote=True)


def _cells(
    state: np.ndarray, refcount: np.ndarray, marked: np.ndarray, group: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per cell of `group` blocks: state shown (the most common in use, else free), the highest
    refcount, whether any block has a finding, and how many blocks are in use."""
    n = len(state)
    cells = -(-n // group)
    pad = cells * group - n
    st = np.concatenate([state.astype(np.int64), np.full(pad, -1)]).reshape(cells, group)
    rc = np.concatenate([refcount.astype(np.int64), np.zeros(pad, np.int64)])
    mk = np.concatenate([marked, np.zeros(pad, bool)]).reshape(cells, group).any(axis=1)
    counts = np.stack([(st == s).sum(axis=1) for s in BlockState], axis=1)
    used = counts[:, 1:].sum(axis=1)
    shown = np.where(used > 0, 1 + np.argmax(counts[:, 1:], axis=1), int(BlockState.FREE))
    invalid = ((st >= len(BlockState)) | (st < -1)).any(axis=1)
    shown = np.where(invalid, -1, shown)
    return shown, rc.reshape(cells, group).max(axis=1), np.asarray(mk), np.asarray(used)


def block_map(
    state: np.ndarray, refcount: np.ndarray, marked: np.ndarray, *, cell: int = 11
) -> tuple[str, int]:
    """The pool as a grid of cells; returns the SVG and the number of blocks per cell."""
    n = len(state)
    group = max(1, -(-n // MAX_CELLS))
    shown, rc, mk, used = _cells(state, refcount, marked, group)
    cols = min(COLUMNS, len(shown)) or 1
    rows = -(-len(shown) // cols)
    w, h = cols * cell, rows * cell
    out = [
        f'<svg class="blockmap" width="{w}" height="{h}"'
        f' viewBox="0 0 {w} {h}" role="img" aria-label="block map">'
    ]
    names = {s.value: s.name.lower() for s in BlockState}
    for i, (s, r, m, u) in enumerate(zip(shown.tolist(), rc.tolist(), mk.tolist(), used.tolist())):
        x, y = (i % cols) * cell, (i // cols) * cell
        fill = INVALID_FILL if s < 0 else STATE_FILLS[BlockState(s)][min(3, max(0, r - 1))]
        stroke = f' stroke="{FINDING_STROKE}" stroke-width="2"' if m else ""
        first = i * group
        what = f"block {first}" if group == 1 else f"blocks {first}-{min(n, first + group) - 1}"
        label = names.get(s, "invalid state")
        if group > 1:
            label += f", {u} of {min(group, n - first)} in use"
        title = f"{what}: {label}, refcount up to {r}" + (", has a finding" if m else "")
        out.append(
            f'<rect x="{x + 0.5}" y="{y + 0.5}" width="{cell - 1}" height="{cell - 1}"'
            f' fill="{fill}"{stroke}><title>{esc(title)}</title></rect>'
        )
    out.append("</svg>")
    return "".join(out), group


def legend() -> str:
    """Swatches for the block map's colours, shades and marks, as an HTML list."""
    items = []
    for s in BlockState:
        fills = STATE_FILLS[s]
        swatches = "".join(
            f'<span class="sw" style="background:{f}"></span>'
            for f in (fills if len(set(fills)) > 1 else fills[:1])
        )
        shade = " (refcount 1, 2, 3, 4+)" if len(set(fills)) > 1 else ""
        items.append(f"<li>{swatches} {s.name.lower()}{shade}</li>")
    items.append(
        f'<li><span class="sw" style="border:2px solid {FINDING_STROKE}"></span>'
        " a block with a finding</li>"
    )
    items.append(
        f'<li><span class="sw" style="background:{INVALID_FILL}"></span> invalid state byte</li>'
    )
    return '<ul class="legend">' + "".join(items) + "</ul>"


def line_chart(
    t_s: np.ndarray,
    series: list[tuple[str, np.ndarray, str]],
    *,
    y_label: str,
    hline: tuple[str, float] | None = None,
    width: int = 720,
    height: int = 200,
) -> str:
    """Step lines of each (label, values, colour) against seconds; an optional labelled
    horizontal line (a limit such as the pool size)."""
    left, right, top, bottom = 56, 12, 10, 30
    pw, ph = width - left - right, height - top - bottom
    t = np.asarray(t_s, np.float64)
    vals = [np.asarray(v, np.float64) for _, v, _ in series]
    lo = 0.0
    hi = max([float(v.max()) for v in vals if len(v)] + [hline[1] if hline else 0.0, 1e-9])
    hi *= 1.05
    t0, t1 = (float(t[0]), float(t[-1])) if len(t) else (0.0, 1.0)
    span = t1 - t0 or 1.0

    def x(v: np.ndarray | float) -> np.ndarray:
        return left + (np.asarray(v, np.float64) - t0) / span * pw

    def y(v: np.ndarray | float) -> np.ndarray:
        return top + ph - (np.asarray(v, np.float64) - lo) / (hi - lo) * ph

    out = [
        f'<svg class="chart" width="{width}" height="{height}"'
        f' viewBox="0 0 {width} {height}" role="img" aria-label="{esc(y_label)}">',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>',
    ]
    for frac in (0.0, 0.5, 1.0):
        tick = lo + frac * (hi / 1.05 - lo)
        out.append(
            f'<text x="{left - 4}" y="{float(y(tick)) + 4:.1f}" text-anchor="end" class="tick">'
            f"{_num(tick)}</text>"
        )
    for frac, anchor in ((0.0, "start"), (0.5, "middle"), (1.0, "end")):
        tv = t0 + frac * span
        out.append(
            f'<text x="{float(x(tv)):.1f}" y="{height - 12}" text-anchor="{anchor}" class="tick">'
            f"{tv:.1f} s</text>"
        )
    out.append(
        f'<text x="12" y="{top + ph / 2:.0f}" class="axis" transform="rotate(-90 12'
        f' {top + ph / 2:.0f})" text-anchor="middle">{esc(y_label)}</text>'
    )
    if hline is not None:
        yy = float(y(hline[1]))
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#888"'
            f' stroke-dasharray="4 3"/><text x="{left + pw - 4}" y="{yy - 3:.1f}"'
            f' text-anchor="end" class="tick">{esc(hline[0])}</text>'
        )
    for (label, _, colour), v in zip(series, vals):
        if not len(v):
            continue
        xs, ys = x(t[: len(v)]), y(v)
        # A step: each value holds until the next sample.
        pts = [f"{xs[0]:.1f},{ys[0]:.1f}"]
        for k in range(1, len(v)):
            pts.append(f"{xs[k]:.1f},{ys[k - 1]:.1f} {xs[k]:.1f},{ys[k]:.1f}")
        out.append(
            f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{" ".join(pts)}">'
            f"<title>{esc(label)}: last {_num(float(v[-1]))}, peak {_num(float(v.max()))}"
            "</title></polyline>"
        )
    out.append("</svg>")
    keys = "".join(
        f'<span class="key"><span class="sw" style="background:{c}"></span>{esc(label)}</span>'
        for label, _, c in series
    )
    return f"<figure>{''.join(out)}<figcaption>{keys}</figcaption></figure>"


def histogram(
    labels: list[str], counts: list[int], *, colour: str, x_label: str, width: int = 420
) -> str:
    """Bars of counts with their labels underneath."""
    height, top, bottom = 170, 16, 40
    n = max(1, len(counts))
    bw = (width - 20) / n
    hi = max(counts + [1])
    out = [
        f'<svg class="chart" width="{width}" height="{height}"'
        f' viewBox="0 0 {width} {height}" role="img" aria-label="{esc(x_label)}">'
    ]
    ph = height - top - bottom
    for k, (label, c) in enumerate(zip(labels, counts)):
        bh = c / hi * ph
        x0 = 10 + k * bw
        out.append(
            f'<rect x="{x0 + 1:.1f}" y="{top + ph - bh:.1f}" width="{max(1.0, bw - 2):.1f}"'
            f' height="{bh:.1f}" fill="{colour}"><title>{esc(label)}: {c}</title></rect>'
            f'<text x="{x0 + bw / 2:.1f}" y="{top + ph - bh - 3:.1f}" text-anchor="middle"'
            f' class="tick">{c}</text><text x="{x0 + bw / 2:.1f}" y="{height - bottom + 14}"'
            f' text-anchor="middle" class="tick">{esc(label)}</text>'
        )
    out.append(
        f'<text x="{width / 2:.0f}" y="{height - 6}" text-anchor="middle" class="axis">'
        f"{esc(x_label)}</text></svg>"
    )
    return "".join(out)


def _num(v: float) -> str:
    if abs(v) >= 100 or float(v).is_integer():
        return f"{v:,.0f}"
    return f"{v:.2f}"
