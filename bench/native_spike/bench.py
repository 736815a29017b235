"""Throughput of the kvcore spike beside the peer BlockManager (and optionally kvscope), one run.

    python bench.py [--repeat 5] [--kvscope] [--scale 1.0]

One core pinned, GC off, median of --repeat runs of each measurement.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvcore  # noqa: E402
from nativepool import NativePool, check  # noqa: E402
from peer_blockmanager import BlockManager, PeerSeq  # noqa: E402

BS = 16
NB = 64 * 1024


def med(fn, reps):
    return statistics.median(fn() for _ in range(reps))


# -- floors -------------------------------------------------------------------------------------


def floor_loop(n):
    t = time.perf_counter()
    for i in range(n):
        pass
    return (time.perf_counter() - t) / n


def floor_noop(n):
    f = kvcore.noop
    t = time.perf_counter()
    for i in range(n):
        f()
    return (time.perf_counter() - t) / n


def floor_noop3(n):
    f = kvcore.noop3
    a = [1, 2]
    t = time.perf_counter()
    for i in range(n):
        f(i, a, -1)
    return (time.perf_counter() - t) / n


def floor_method(n):
    """A bound C method through a Python method: the wrapper's shape, doing nothing."""

    class W:
        __slots__ = ("_f",)

        def __init__(self):
            self._f = kvcore.noop3

        def op(self, x, y):
            return self._f(x, y, -1)

    w = W()
    a = [1, 2]
    t = time.perf_counter()
    for i in range(n):
        w.op(i, a)
    return (time.perf_counter() - t) / n


# -- single pairs -------------------------------------------------------------------------------


def single_wrapper(pool, n):
    t = time.perf_counter()
    for i in range(n):
        pool.free(pool.allocate("s", [i, 1, 2]))
    return n / (time.perf_counter() - t)


def single_bare(pool, n):
    alloc, free = pool.core.alloc, pool.core.free
    t = time.perf_counter()
    for i in range(n):
        slot, sid, table = alloc("s", [i, 1, 2], -1)
        free(slot, table)
    return n / (time.perf_counter() - t)


def single_c(pool, n):
    return n / pool.core.bench_pairs(n, 3)


def single_peer(bm, n):
    t = time.perf_counter()
    for i in range(n):
        s = PeerSeq([i, 1, 2])
        bm.allocate(s)
        bm.deallocate(s)
    return n / (time.perf_counter() - t)


# -- 64-block batches ---------------------------------------------------------------------------


def _toks():
    return [random.randrange(30000) for _ in range(64 * BS)]


def batch_wrapper(pool, n):
    toks = _toks()
    t = time.perf_counter()
    for i in range(n):
        toks[0] = i
        pool.free(pool.allocate("b", toks))
    return 64 * n / (time.perf_counter() - t)


def batch_bare(pool, n):
    toks = _toks()
    alloc, free = pool.core.alloc, pool.core.free
    t = time.perf_counter()
    for i in range(n):
        toks[0] = i
        slot, sid, table = alloc("b", toks, -1)
        free(slot, table)
    return 64 * n / (time.perf_counter() - t)


def batch_c(pool, n):
    return 64 * n / pool.core.bench_pairs(n, 64 * BS)


def batch_peer(bm, n):
    toks = _toks()
    t = time.perf_counter()
    for i in range(n):
        toks[0] = i
        s = PeerSeq(toks)
        bm.allocate(s)
        bm.deallocate(s)
    return 64 * n / (time.perf_counter() - t)


# -- append one token ---------------------------------------------------------------------------


def append_wrapper(pool, n):
    t = time.perf_counter()
    seq = pool.allocate("a", [1])
    for i in range(n):
        if seq.num_tokens >= 1024:
            pool.free(seq)
            seq = pool.allocate("a", [1])
        pool.append(seq, [i])
    rate = n / (time.perf_counter() - t)
    pool.free(seq)
    return rate


def append_bare(pool, n):
    c = pool.core
    alloc, free, ap = c.alloc, c.free, c.append1
    t = time.perf_counter()
    slot, sid, table = alloc("a", [1], -1)
    k = 1
    for i in range(n):
        if k >= 1024:
            free(slot, table)
            slot, sid, table = alloc("a", [1], -1)
            k = 1
        k = ap(slot, table, k, i)
    rate = n / (time.perf_counter() - t)
    free(slot, table)
    return rate


def append_c(pool, n):
    return n / pool.core.bench_append(n)


def append_peer(bm, n):
    t = time.perf_counter()
    seq = PeerSeq([1])
    bm.allocate(seq)
    for i in range(n):
        if len(seq.tokens) >= 1024:
            bm.deallocate(seq)
            seq = PeerSeq([1])
            bm.allocate(seq)
        bm.append(seq, i)
    rate = n / (time.perf_counter() - t)
    bm.deallocate(seq)
    return rate


# -- the sequence workload without the prefix index (an upper bound for that part) --------------


def workload(num_seqs, seed):
    rng = random.Random(seed)
    systems = [[rng.randrange(30000) for _ in range(256)] for _ in range(10)]
    out = []
    for _ in range(num_seqs):
        own = [rng.randrange(30000) for _ in range(rng.randint(40, 200))]
        out.append(rng.choice(systems) + own if rng.random() < 0.7 else own)
    return out


def seqs_native(pool, prompts, decode=64, running=64):
    """bench_pool.seqs_ours minus mark_computed (no prefix index in the spike: every prompt
    block is a new block, nothing is published)."""
    t = time.perf_counter()
    live = []
    pending = iter(prompts)
    done = 0
    tok = 0
    while done < len(prompts):
        while len(live) < running:
            p = next(pending, None)
            if p is None:
                break
            s = pool.allocate("w", p)
            live.append([s, decode])
        for item in live:
            s = item[0]
            tok += 1
            pool.append(s, [tok])
            if s.num_tokens % BS == 0:
                pass  # kvscope: pool.mark_computed(s, s.num_tokens)
            item[1] -= 1
        for item in [x for x in live if x[1] == 0]:
            pool.free(item[0])
            live.remove(item)
            done += 1
    return len(prompts) / (time.perf_counter() - t)


def seqs_peer(bm, prompts, decode=64, running=64):
    t = time.perf_counter()
    live = []
    pending = iter(prompts)
    done = 0
    tok = 0
    while done < len(prompts):
        while len(live) < running:
            p = next(pending, None)
            if p is None:
                break
            s = PeerSeq(p)
            bm.allocate(s)
            live.append([s, decode])
        for item in live:
            tok += 1
            bm.append(item[0], tok)
            item[1] -= 1
        for item in [x for x in live if x[1] == 0]:
            bm.deallocate(item[0])
            live.remove(item)
            done += 1
    return len(prompts) / (time.perf_counter() - t)


# -------------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--kvscope", action="store_true", help="also time kvscope's KVPool (slow)")
    args = ap.parse_args(argv)
    R, S = args.repeat, args.scale
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    gc.disable()
    random.seed(0)
    out = {}

    def note(key, val, unit):
        out[key] = val
        print(f"  {key}: {val:,.1f} {unit}", file=sys.stderr, flush=True)

    n = int(2_000_000 * S)
    loop = med(lambda: floor_loop(n), R)
    note("floor: empty for-loop iteration (ns)", loop * 1e9, "ns")
    note("floor: no-op C call, no args (ns, loop subtracted)", (med(lambda: floor_noop(n), R) - loop) * 1e9, "ns")
    note("floor: no-op C fastcall, 3 args (ns, loop subtracted)", (med(lambda: floor_noop3(n), R) - loop) * 1e9, "ns")
    note("floor: Python method -> C fastcall (ns, loop subtracted)", (med(lambda: floor_method(n), R) - loop) * 1e9, "ns")

    pool = NativePool(uuid.uuid4().hex[:8], NB, local_cap=4)
    pool32 = NativePool(uuid.uuid4().hex[:8], NB, local_cap=32)
    poolfull = NativePool(uuid.uuid4().hex[:8], NB, local_cap=4, full_checksum=True)
    poolc = NativePool(uuid.uuid4().hex[:8], NB, local_cap=4, c_api=True)
    try:
        note("fcntl lock round trip incl. lock record (ns)", med(lambda: pool.core.lock_roundtrips(int(200_000 * S)), R) / int(200_000 * S) * 1e9, "ns")
        ns = int(300_000 * S)
        note("single: wrapper", med(lambda: single_wrapper(pool, ns), R), "pairs/s")
        note("single: C-typed handle", med(lambda: single_wrapper(poolc, ns), R), "pairs/s")
        note("single: bare C calls", med(lambda: single_bare(pool, ns), R), "pairs/s")
        note("single: pure C loop", med(lambda: single_c(pool, 4 * ns), R), "pairs/s")
        note("single: pure C loop, full-record checksum", med(lambda: single_c(poolfull, 4 * ns), R), "pairs/s")
        note("single: peer", med(lambda: single_peer(BlockManager(NB, BS), ns), R), "pairs/s")
        nb_ = int(20_000 * S)
        note("batch: wrapper", med(lambda: batch_wrapper(pool, nb_), R), "blocks/s")
        note("batch: C-typed handle", med(lambda: batch_wrapper(poolc, nb_), R), "blocks/s")
        note("batch: bare C calls", med(lambda: batch_bare(pool, nb_), R), "blocks/s")
        note("batch: pure C loop", med(lambda: batch_c(pool, nb_), R), "blocks/s")
        note("batch: wrapper, local_cap 32", med(lambda: batch_wrapper(pool32, nb_), R), "blocks/s")
        note("batch: pure C loop, local_cap 32", med(lambda: batch_c(pool32, nb_), R), "blocks/s")
        note("batch: pure C loop, full-record checksum", med(lambda: batch_c(poolfull, nb_), R), "blocks/s")
        note("batch: peer", med(lambda: batch_peer(BlockManager(NB, BS), nb_ // 4), R), "blocks/s")
        na = int(1_000_000 * S)
        note("append: wrapper", med(lambda: append_wrapper(pool, na), R), "appends/s")
        note("append: C-typed handle", med(lambda: append_wrapper(poolc, na), R), "appends/s")
        note("append: bare C call", med(lambda: append_bare(pool, na), R), "appends/s")
        note("append: pure C loop", med(lambda: append_c(pool, 4 * na), R), "appends/s")
        note("append: peer", med(lambda: append_peer(BlockManager(NB, BS), na), R), "appends/s")
        prompts = workload(int(5000 * S), 1)
        note("seqs (no prefix index): wrapper", med(lambda: seqs_native(pool, prompts), 3), "seqs/s")
        note("seqs (no prefix index): C-typed handle", med(lambda: seqs_native(poolc, prompts), 3), "seqs/s")
        note("seqs: peer", med(lambda: seqs_peer(BlockManager(NB, BS), prompts), 3), "seqs/s")
        for p in (pool, pool32, poolfull, poolc):
            errs = check(p)
            assert not errs, errs
        print("  consistency check after the run: ok;", pool.core.stats(), file=sys.stderr)
    finally:
        for p in (pool, pool32, poolfull, poolc):
            p.close()

    if args.kvscope:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        import bench_pool as bp  # bench/

        kp = bp.new_pool(NB)
        try:
            note("kvscope KVPool: single", med(lambda: bp.single_ours(kp, int(20000 * S)), 3), "pairs/s")
            note("kvscope KVPool: batch", med(lambda: bp.batch_ours(kp, int(1000 * S)), 3), "blocks/s")
            note("kvscope KVPool: append", med(lambda: bp.append_ours(kp, int(50000 * S)), 3), "appends/s")
        finally:
            kp.close()
            kp.unlink()

    print()
    print("| workload | target | C core via Python wrapper | C-typed handle, API methods in C | bare C calls from Python | pure C loop (no CPython) | peer BlockManager | kvscope today |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    g = out.get
    ks = lambda k: f"{g(k):,.0f}" if k in out else "—"  # noqa: E731
    rows = [
        ("allocate+free single pairs (pairs/s)", "700,000", "single: wrapper", "single: C-typed handle", "single: bare C calls", "single: pure C loop", "single: peer", "kvscope KVPool: single"),
        ("allocate+free 64-block batches (blocks/s)", "3,000,000", "batch: wrapper", "batch: C-typed handle", "batch: bare C calls", "batch: pure C loop", "batch: peer", "kvscope KVPool: batch"),
        ("append one token (appends/s)", "—", "append: wrapper", "append: C-typed handle", "append: bare C call", "append: pure C loop", "append: peer", "kvscope KVPool: append"),
        ("sequence workload, no prefix index (seqs/s)", "5,100", "seqs (no prefix index): wrapper", "seqs (no prefix index): C-typed handle", None, None, "seqs: peer", None),
    ]
    for label, tgt, a, a2, b, c, d, e in rows:
        print(f"| {label} | {tgt} | {ks(a)} | {ks(a2)} | {ks(b) if b else '—'} | {ks(c) if c else '—'} | {ks(d)} | {ks(e) if e else '—'} |")
    print()
    print("| per-operation cost (ns) | Python wrapper | C-typed handle | bare C call | pure C | of the wrapper time: Python wrapper / CPython call+arg conversion / C work |")
    print("|---|---:|---:|---:|---:|---|")
    for label, a, a2, b, c in [
        ("single pair (allocate+free)", "single: wrapper", "single: C-typed handle", "single: bare C calls", "single: pure C loop"),
        ("64-block batch, per block", "batch: wrapper", "batch: C-typed handle", "batch: bare C calls", "batch: pure C loop"),
        ("append one token", "append: wrapper", "append: C-typed handle", "append: bare C call", "append: pure C loop"),
    ]:
        w, w2, bb, cc = 1e9 / g(a), 1e9 / g(a2), 1e9 / g(b), 1e9 / g(c)
        print(f"| {label} | {w:,.0f} | {w2:,.0f} | {bb:,.0f} | {cc:,.0f} | {(w - bb) / w:.0%} / {(bb - cc) / w:.0%} / {cc / w:.0%} |")
    print()
    for k in [k for k in out if k.startswith("floor") or k.startswith("fcntl")]:
        print(f"- {k}: {out[k]:,.1f}")
    for k in [k for k in out if "checksum" in k or "local_cap" in k]:
        print(f"- {k}: {out[k]:,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
