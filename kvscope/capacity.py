"""The capacity answer: is the pool too small, or is the peak just spiky, and what size would
have served the run without preemption (from the pool's recorded history, kvscope.history).

Demand at a moment is the blocks the requests wanted then: those held by sequences plus those
the preempted sequences needed back. A pool of the peak demand serves the run without
preemption when one process uses it; with several, each process also parks up to
`local_cache_size` free blocks in its local cache, which the others cannot take, on top. The
peak is over the samples; sampling can miss a brief peak, so where preemptions happened and no
sample saw demand beyond the pool, the answer says so instead of naming a size.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvscope.allocator.layout import SegmentView, SeqState
from kvscope.allocator.stats import pool_stats
from kvscope.history import History

# Mean demand at or above this share of the pool: the pool is too small, not just spiky.
TOO_SMALL = 0.9


def _time_weighted_mean(t: np.ndarray, v: np.ndarray) -> float:
    """Mean of a step function sampled at t (each value holds until the next sample)."""
    if len(v) == 1:
        return float(v[0])
    dt = np.diff(t).astype(np.float64)
    total = float(dt.sum())
    if total <= 0:
        return float(v.mean())
    return float((v[:-1] * dt).sum() / total)


def capacity_answer(view: SegmentView, history: History | None) -> dict[str, Any]:
    """Peak vs mean demand, preemptions and the pool size that would have avoided them all."""
    n = view.layout.num_blocks
    st = pool_stats(view)
    out: dict[str, Any] = {
        "num_blocks": n,
        "num_preemptions": st["num_preemptions"],
        "num_evictions": st["num_evictions"],
    }
    if history is None or history.count == 0:
        seqs = view.seqs
        pre = seqs["state"] == SeqState.PREEMPTED
        bs = int(view.h["block_size"])
        wanted = int(((seqs["num_tokens"][pre].astype(np.int64) + bs - 1) // bs).sum())
        held = st["num_allocated"]
        out.update(
            source="snapshot",
            demand_now=held + wanted,
            refcount_peak_now=st["refcount_peak"],
            answer=(
                "no recorded history: `kvscope run` samples the pool and writes it beside its"
                " dump; this snapshot alone cannot tell a peak from the mean"
            ),
        )
        return out
    s = history.samples
    t = s["time_ns"]
    demand = s["demand"]
    peak = int(s["demand_max"].max())
    mean = _time_weighted_mean(t, demand.astype(np.float64))
    preempted = int(s["num_preemptions"][-1] - s["num_preemptions"][0])
    # Preemptions before the first sample still count: the pool's own counter says so.
    preempted = max(preempted, st["num_preemptions"])
    out.update(
        source="history",
        num_samples=int(history.count),
        span_s=float((t[-1] - t[0]) / 1e9),
        interval_s=history.interval_s,
        peak_demand=peak,
        mean_demand=round(mean, 1),
        peak_to_mean=round(peak / mean, 2) if mean > 0 else None,
        peak_held=int(s["allocated_max"].max()),
        refcount_peak=int(s["refcount_peak_max"].max()),
        num_preemptions=preempted,
    )
    if preempted == 0:
        out["pool_size_without_preemption"] = min(n, peak)
        out["answer"] = (
            f"big enough: no preemption; peak demand {peak} of {n} blocks"
            f" ({100 * peak / n:.0f}%), mean {mean:.0f}"
        )
    elif peak <= n:
        out["pool_size_without_preemption"] = None
        out["answer"] = (
            f"{preempted} preemption(s), but no sample (every {history.interval_s:g} s or"
            f" less) saw demand beyond the pool's {n} blocks: the peaks were shorter than the"
            f" sampling interval; more than {n} blocks would be needed"
        )
    else:
        out["pool_size_without_preemption"] = peak
        kind = "too small" if mean >= TOO_SMALL * n else "spiky"
        out["answer"] = (
            f"{kind}: {preempted} preemption(s); peak demand {peak} blocks is"
            f" {peak / max(mean, 1e-9):.1f}x the mean {mean:.0f} ({100 * mean / n:.0f}% of the"
            f" pool); a pool of {peak} blocks (+{peak - n}) would have served this run without"
            " preemption"
        )
    return out
