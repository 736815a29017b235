"""The capacity answer: is the pool too small, or is the peak just spiky, and what size would
have served the run without preemption (from the pool's recorded history, kvscope.history).

Demand at a moment is the blocks the requests wanted then: those held by sequences plus those
the preempted sequences needed back. A pool of the peak demand serves the run without
preemption when one process uses it; with several, each process also parks up to
`local_cache_size` free blocks in its local cache, which the others cannot take, on top. The
peak is over the samples; sampling can miss a brief peak, so where preemptions happened and no
sample saw demand beyond the pool, the answer says so instead of naming a size.

A PoolExhausted leaves no demand behind (the failed take is undone) and can fall between two
samples, so the samples alone would call such a pool big enough. The C core counts every one
(`num_exhausted`) and records the last one's figures in the header (allocator/stats.py
`last_exhaustion`): where blocks free in other processes' local caches, which the take cannot
reach, would have served it, the answer names those ("memory still free"); where it found none,
or too few, the pool was too small for that moment. A pool that raised one is never "big enough".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvscope.allocator.layout import BlockState, ClientState, SegmentView, SeqState
from kvscope.allocator.process import is_alive
from kvscope.allocator.stats import pool_stats
from kvscope.history import History
from kvscope.poolsummary import Alive

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


def _plural(k: int, word: str) -> str:
    return f"{k} {word}{'' if k == 1 else 's'}"


def _short(last: dict[str, int] | None) -> int:
    """The blocks the last PoolExhausted's take was short by, free ones all counted: every
    block it could not have was held then (eviction and preemption had run out), so the pool
    it needed was at least this many blocks larger."""
    if last is None:
        return 0
    return max(0, last["needed"] - last["free_list"] - last["own_cache"] - last["other_caches"])


def exhaustion_answer(
    num_exhausted: int, last: dict[str, int] | None, num_blocks: int
) -> tuple[str | None, str]:
    """What the pool's PoolExhausted count and its last one's figures (stats.last_exhaustion)
    say: (cause, sentence); cause "memory_still_free" where blocks in other processes' local
    caches would have served the last one, "pool_too_small" where it found none or too few,
    None where its figures were not recorded. (None, "") where none was raised."""
    if num_exhausted <= 0:
        return None, ""
    times = _plural(num_exhausted, "time")
    if last is None:
        return None, f"PoolExhausted raised {times} (the last one's figures were not recorded)"
    need, free, own, other = (
        last["needed"],
        last["free_list"],
        last["own_cache"],
        last["other_caches"],
    )
    short = _short(last)
    if other > 0 and not short:
        # Free blocks the take could not reach: the pool's memory was there, parked in other
        # processes' local caches (each keeps up to twice local_cache_size).
        return "memory_still_free", (
            f"memory still free: {other} blocks in other processes' local caches at the last"
            f" PoolExhausted (raised {times}): pid {last['pid']} needed"
            f" {_plural(need, 'block')} with {free} free in the shared free list and {own} in its own local cache; a"
            " smaller local_cache_size, or pool.flush_local() in the processes that stop"
            " allocating, hands them back"
        )
    # (blocks parked in other caches too few to serve it: the pool was too small, whatever
    # the caches held)
    parked = (
        f" and {other} in other processes' local caches, which it cannot take (a smaller"
        " local_cache_size, or pool.flush_local() in the processes that stop allocating, hands"
        " those back), even with them"
        if other
        else " and none in other processes' local caches"
    )
    return "pool_too_small", (
        f"pool too small: PoolExhausted raised {times}; the last (pid {last['pid']}) needed"
        f" {_plural(need, 'block')} with {free} free in the shared free list, {own} in its own"
        f" local cache{parked}: a pool of at least {num_blocks + short} blocks (+{short}) would have"
        " served it"
    )


def _holders(view: SegmentView, alive: Alive) -> list[int]:
    """The client slots of handles that still hold the pool (attached, their process alive)."""
    clients = view.clients
    attached = np.flatnonzero(clients["state"] == ClientState.ATTACHED)
    return [c for c in attached.tolist() if alive(int(clients["pid"][c]), int(clients["start"][c]))]


def stranded_blocks(view: SegmentView, alive: Alive = is_alive) -> int:
    """Blocks held (ALLOCATED) by a handle that no longer holds the pool: one closed with them
    (leaked requests) or whose process died attached (by the blocks' owner_client). What the samples counted as
    demand, though no request was served with them."""
    holders = _holders(view, alive)
    stranded = (view.blocks["state"] == BlockState.ALLOCATED) & ~np.isin(
        view.blocks["owner_client"], holders
    )
    # (a shared prefix block its allocator left behind is not stranded while a request of a
    # process holding the pool maps it)
    seqs = view.seqs
    live = np.flatnonzero(
        (seqs["state"] != SeqState.EMPTY) & np.isin(seqs["owner_client"], holders)
    )
    for s in live.tolist():
        table = seqs["table"][s, : int(seqs["num_blocks"][s])]
        stranded[table[(table >= 0) & (table < len(stranded))]] = False
    return int(stranded.sum())


def stranded_preempted(view: SegmentView, alive: Alive = is_alive) -> tuple[int, int]:
    """(sequences, blocks): the preempted sequences of handles that no longer hold the pool
    (requests their engine lost while they waited: nothing can resume them) and the blocks
    they wanted back, which the samples counted as demand (kvscope.history) from their
    preemption on."""
    seqs = view.seqs
    lost = (seqs["state"] == SeqState.PREEMPTED) & ~np.isin(
        seqs["owner_client"], _holders(view, alive)
    )
    bs = int(view.h["block_size"])
    wanted = (seqs["num_tokens"][lost].astype(np.int64) + bs - 1) // bs
    return int(lost.sum()), int(wanted.sum())


def _stranded_note(k: int, seqs: int = 0, wanted: int = 0) -> str:
    """The answer's last clause where `k` blocks were stranded, or `seqs` preempted sequences
    wanting `wanted` blocks back were lost: the demand counted them."""
    parts = []
    if k:
        parts.append(
            f"{k} of the blocks held at the end belong to no process holding the pool (leaked"
            f" requests, or a dead process's: the leak findings)"
        )
    if seqs:
        parts.append(
            f"{_plural(seqs, 'preempted sequence')} of no process holding the pool, neither"
            f" resumed nor ended, wanted {_plural(wanted, 'block')} back (requests lost while"
            f" they waited: the leak findings)"
        )
    return (
        f"; {' and '.join(parts)}: the demand above counts them, so fix those before growing"
        f" the pool"
    )


# A pool that stood idle at least this long, and this share of the recorded span, at the end
# of the history, with room an allocation takes that num_free leaves out (idle_with_room).
IDLE_S = 5.0
IDLE_SHARE = 0.5


def idle_with_room(history: History | None, n: int) -> dict[str, Any] | None:
    """The end of the run where no request held a block and none was allocated, for at least
    IDLE_S seconds and IDLE_SHARE of the history's span, while free blocks made less than a
    quarter of the pool's `n` and cached and quarantined ones (which an allocation takes: it evicts
    the one and hands out the other) a quarter or more: what an engine that stopped admitting
    with the memory still there shows (an admission check counting stats()["num_free"]), and
    an idle one too. None otherwise."""
    if history is None or history.count < 2:
        return None
    s = history.samples
    t = s["time_ns"]
    allocs = s["num_allocs"]
    busy = np.flatnonzero((s["demand"] > 0) | (np.diff(allocs, prepend=allocs[0]) > 0))
    if not len(busy) or busy[-1] == len(s) - 1:
        return None
    idle = (t[-1] - t[busy[-1]]) / 1e9
    span = (t[-1] - t[0]) / 1e9
    end = s[-1]
    free, room = int(end["num_free"]), int(end["num_cached"] + end["num_quarantined"])
    if idle < IDLE_S or idle < IDLE_SHARE * span or 4 * free >= n or 4 * room < n:
        return None
    return {
        "idle_s": round(float(idle), 1),
        "span_s": round(float(span), 1),
        "free": free,
        "cached": int(end["num_cached"]),
        "quarantined": int(end["num_quarantined"]),
    }


def _idle_note(idle: dict[str, Any], n: int) -> str:
    return (
        f"; for the last {idle['idle_s']:g} s of the run (of {idle['span_s']:g} s) no request held"
        f" a block and none was allocated, with {idle['free']} of the pool's {n} blocks free but"
        f" {idle['cached']} cached and {idle['quarantined']} quarantined, which an allocation"
        f" takes (it evicts cached blocks and hands out quarantined ones): if requests were"
        f" waiting then, the engine stopped admitting with the pool's memory still there, as an"
        f" admission check counting stats()['num_free'] does (guard mode's quarantine, under"
        f" kvscope run, keeps freed blocks out of it sooner); count stats()['num_available'],"
        f" or allocate and handle PoolExhausted"
    )


def capacity_answer(
    view: SegmentView, history: History | None, alive: Alive = is_alive
) -> dict[str, Any]:
    """Peak vs mean demand, preemptions, PoolExhausted raised, and the pool size that would
    have avoided them all; where the run ended idle with room that num_free leaves out
    (`idle_with_room`), says so."""
    out = _capacity_answer(view, history)
    idle = idle_with_room(history, out["num_blocks"])
    if idle is not None:
        out["idle_with_room"] = idle
        out["answer"] += _idle_note(idle, out["num_blocks"])
    if out["num_exhausted"] or out["num_preemptions"]:
        k = stranded_blocks(view, alive)
        seqs, wanted = stranded_preempted(view, alive)
        n = out["num_blocks"]
        if k and (4 * k >= n or k >= _short(out["last_exhausted"]) > 0):
            # (the stranded blocks alone would have served the last take, or hold a quarter
            # of the pool: that is the answer, before what the demand counted with them says)
            out["answer"] = (
                f"blocks stranded, not a pool too small: {k} of the pool's {n} blocks are held"
                " by no process holding the pool (a dead process's requests, or leaked ones:"
                " the leak findings); pool.reclaim_dead() (or `kvscope check NAME --repair`)"
                " hands a dead process's back, and leaked requests are the engine's to free."
                " Counting them as demand: " + out["answer"]
            )
            if seqs:
                out["answer"] += _stranded_note(0, seqs, wanted)
        elif k or seqs:
            out["answer"] += _stranded_note(k, seqs, wanted)
        if k:
            out["stranded_blocks"] = k
        if seqs:
            out["stranded_preempted"] = {"sequences": seqs, "blocks": wanted}
    return out


def _capacity_answer(view: SegmentView, history: History | None) -> dict[str, Any]:
    n = view.layout.num_blocks
    st = pool_stats(view)
    exhausted = st["num_exhausted"]
    cause, exhaustion = exhaustion_answer(exhausted, st["last_exhausted"], n)
    out: dict[str, Any] = {
        "num_blocks": n,
        "num_preemptions": st["num_preemptions"],
        "num_evictions": st["num_evictions"],
        "num_exhausted": exhausted,
        "last_exhausted": st["last_exhausted"],
        "exhaustion_cause": cause,
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
                (exhaustion + "; " if exhaustion else "")
                + "no recorded history: `kvscope run` samples the pool and writes it beside its"
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
    if cause == "memory_still_free":
        # The pool's size was not what failed: a larger one would strand more in the caches.
        out["pool_size_without_preemption"] = None
        out["answer"] = (
            f"{exhaustion}; {preempted} preemption(s), peak demand {peak} of {n} blocks in the"
            " samples"
        )
    elif exhausted and peak <= n:
        out["pool_size_without_preemption"] = None
        out["answer"] = (
            f"{exhaustion}; no sample (every {history.interval_s:g} s or less) saw demand"
            f" beyond the pool's {n} blocks: the peak was shorter than the sampling interval"
        )
    elif preempted == 0 and not exhausted and peak == 0 and st["num_allocs"]:
        # (the requests came and went between two samples: a short run's whole serving)
        out["pool_size_without_preemption"] = None
        out["answer"] = (
            f"no preemption; no sample (every {history.interval_s:g} s or less) saw a request"
            f" holding blocks, though {st['num_allocs']} block(s) were allocated: the"
            " serving was shorter than the sampling interval, and the peak is not known"
        )
    elif preempted == 0 and not exhausted:
        out["pool_size_without_preemption"] = min(n, peak)
        out["answer"] = (
            f"big enough: no preemption; peak demand {peak} of {n} blocks"
            f" ({100 * peak / n:.0f}%), mean {round(mean, 1)}"
        )
    elif peak <= n:
        out["pool_size_without_preemption"] = None
        out["answer"] = (
            f"{preempted} preemption(s), but no sample (every {history.interval_s:g} s or"
            f" less) saw demand beyond the pool's {n} blocks: the peaks were shorter than the"
            f" sampling interval; more than {n} blocks would be needed"
        )
    else:
        # (and at least the size the last PoolExhausted's take needed)
        size = max(peak, n + _short(st["last_exhausted"]))
        out["pool_size_without_preemption"] = size
        kind = "too small" if mean >= TOO_SMALL * n else "spiky"
        if exhaustion:
            lead = f"{exhaustion}; " + ("" if kind == "too small" else "spiky demand, ")
        else:
            lead = f"{kind}: "
        out["answer"] = (
            f"{lead}{preempted} preemption(s); peak demand {peak} blocks is"
            f" {peak / max(mean, 1e-9):.1f}x the mean demand of {mean:.0f} (the mean is"
            f" {100 * mean / n:.0f}% of the pool's {n}); a pool of {size} blocks (+{size - n}) would have served this run without"
            " preemption" + (" or PoolExhausted" if exhausted else "")
        )
    return out
