"""Pool throughput: the shared, journaled KVPool beside a plain in-process peer, same workloads.

    python bench/bench_pool.py            # full run (about a minute or two)
    python bench/bench_pool.py --quick    # smaller workloads, for a smoke test

One core pinned, GC off, median of --repeat runs after a warm-up run. Prints a markdown table
with ratios.
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
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(__file__))

from peer_blockmanager import BlockManager, PeerSeq  # noqa: E402

from kvscope.allocator import KVPool, PoolConfig  # noqa: E402

BS = 16


def new_pool(num_blocks: int) -> KVPool:
    cfg = PoolConfig(num_blocks=num_blocks, block_size=BS, num_layers=1, num_kv_heads=1, head_dim=8)
    return KVPool.create(f"bench-{uuid.uuid4().hex[:8]}", cfg)


def median_rate(fn: Callable[[], float], repeat: int) -> float:
    """fn returns ops/s for one run; the median over runs, after one untimed warm-up run (the
    first ~0.1 s after a pool is made measure up to 25% slow on this machine, for kvscope and
    the peer alike)."""
    fn()
    return statistics.median(fn() for _ in range(repeat))


# -- micro workloads ---------------------------------------------------------------------------


def batch_ours(pool: KVPool, n: int) -> float:
    toks = [random.randrange(30000) for _ in range(64 * BS)]
    t = time.perf_counter()
    for i in range(n):
        toks[0] = i  # a new prompt each time: no prefix hits
        pool.free(pool.allocate("b", toks))
    return 64 * n / (time.perf_counter() - t)


def batch_peer(bm: BlockManager, n: int) -> float:
    toks = [random.randrange(30000) for _ in range(64 * BS)]
    t = time.perf_counter()
    for i in range(n):
        toks[0] = i
        s = PeerSeq(toks)
        bm.allocate(s)
        bm.deallocate(s)
    return 64 * n / (time.perf_counter() - t)


def single_ours(pool: KVPool, n: int) -> float:
    t = time.perf_counter()
    for i in range(n):
        pool.free(pool.allocate("s", [i, 1, 2]))
    return n / (time.perf_counter() - t)


def single_peer(bm: BlockManager, n: int) -> float:
    t = time.perf_counter()
    for i in range(n):
        s = PeerSeq([i, 1, 2])
        bm.allocate(s)
        bm.deallocate(s)
    return n / (time.perf_counter() - t)


def append_ours(pool: KVPool, n: int) -> float:
    # One token at a time; a fresh sequence every 1024 tokens (64 blocks).
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


def append_peer(bm: BlockManager, n: int) -> float:
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


def fork_ours(pool: KVPool, n: int) -> float:
    seq = pool.allocate("f", list(range(16 * BS)))
    t = time.perf_counter()
    for _ in range(n):
        pool.free(pool.fork(seq, "c"))
    rate = n / (time.perf_counter() - t)
    pool.free(seq)
    return rate


def fork_peer(bm: BlockManager, n: int) -> float:
    seq = PeerSeq(list(range(16 * BS)))
    bm.allocate(seq)
    t = time.perf_counter()
    for _ in range(n):
        bm.deallocate(bm.fork(seq))
    rate = n / (time.perf_counter() - t)
    bm.deallocate(seq)
    return rate


def hit_ours(pool: KVPool, n: int) -> float:
    prompt = list(range(16 * BS + 1))
    seq = pool.allocate("p", prompt)
    pool.mark_computed(seq, len(prompt))
    t = time.perf_counter()
    for _ in range(n):
        s = pool.allocate("h", prompt)
        assert s.num_cached_tokens == 16 * BS
        pool.free(s)
    rate = n / (time.perf_counter() - t)
    pool.free(seq)
    return rate


def hit_peer(bm: BlockManager, n: int) -> float:
    prompt = list(range(16 * BS + 1))
    seq = PeerSeq(prompt)
    bm.allocate(seq)
    t = time.perf_counter()
    for _ in range(n):
        s = PeerSeq(prompt)
        bm.allocate(s)
        bm.deallocate(s)
    rate = n / (time.perf_counter() - t)
    bm.deallocate(seq)
    return rate


# -- the sequence workload -----------------------------------------------------------------------


def workload(num_seqs: int, seed: int) -> list[list[int]]:
    """Prompts of 40-200 tokens; 70% behind one of 10 shared 256-token system prompts."""
    rng = random.Random(seed)
    systems = [[rng.randrange(30000) for _ in range(256)] for _ in range(10)]
    out = []
    for _ in range(num_seqs):
        own = [rng.randrange(30000) for _ in range(rng.randint(40, 200))]
        out.append(rng.choice(systems) + own if rng.random() < 0.7 else own)
    return out


def seqs_ours(pool: KVPool, prompts: list[list[int]], decode: int = 64, running: int = 64) -> float:
    t = time.perf_counter()
    live: list = []
    pending = iter(prompts)
    done = 0
    tok = 0
    while done < len(prompts):
        while len(live) < running:
            p = next(pending, None)
            if p is None:
                break
            s = pool.allocate("w", p)
            pool.mark_computed(s, len(p))
            live.append([s, decode])
        for item in live:
            s = item[0]
            tok += 1
            pool.append(s, [tok])
            if s.num_tokens % BS == 0:
                pool.mark_computed(s, s.num_tokens)
            item[1] -= 1
        for item in [x for x in live if x[1] == 0]:
            pool.free(item[0])
            live.remove(item)
            done += 1
    return len(prompts) / (time.perf_counter() - t)


def seqs_peer(
    bm: BlockManager, prompts: list[list[int]], decode: int = 64, running: int = 64
) -> float:
    t = time.perf_counter()
    live: list = []
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


def seqs_multi(num_procs: int, prompts: list[list[int]], num_blocks: int) -> float:
    """Aggregate sequences/s of num_procs processes sharing one pool (wall clock, all running)."""
    pool = new_pool(num_blocks)
    r, w = os.pipe()
    pids = []
    share = len(prompts) // num_procs
    for k in range(num_procs):
        pid = os.fork()
        if pid == 0:
            os.close(w)
            mine = KVPool.attach(pool.name)
            os.read(r, 1)  # start together
            seqs_ours(mine, prompts[k * share : (k + 1) * share], running=64 // num_procs)
            mine.close()
            os._exit(0)
        pids.append(pid)
    os.close(r)
    time.sleep(0.2)
    t = time.perf_counter()
    os.write(w, b"x" * num_procs)
    for p in pids:
        os.waitpid(p, 0)
    rate = share * num_procs / (time.perf_counter() - t)
    pool.close()
    pool.unlink()
    return rate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small workloads (smoke test)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seqs", type=int, default=10_000, help="sequences in the sequence workload")
    args = ap.parse_args(argv)
    scale = 0.1 if args.quick else 1.0
    reps = 1 if args.quick else args.repeat
    nseq = max(200, int(args.seqs * scale))
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    gc.disable()
    random.seed(0)
    num_blocks = 64 * 1024
    rows = []
    pool = new_pool(num_blocks)
    try:
        micro = [
            ("allocate+free, batches of 64 (blocks/s)", batch_ours, batch_peer, int(2000 * scale)),
            ("allocate+free, single pairs (pairs/s)", single_ours, single_peer, int(20000 * scale)),
            ("append one token (appends/s)", append_ours, append_peer, int(50000 * scale)),
            ("fork+free of 16 blocks (forks/s)", fork_ours, fork_peer, int(5000 * scale)),
            ("prefix hit of 16 blocks (allocs/s)", hit_ours, hit_peer, int(5000 * scale)),
        ]
        for label, ours, peer, n in micro:
            bm = BlockManager(num_blocks, BS)
            o = median_rate(lambda ours=ours, n=n: ours(pool, n), reps)
            p = median_rate(lambda peer=peer, n=n, bm=bm: peer(bm, n), reps)
            rows.append((label, o, p))
            print(f"{label}: kvscope {o:,.0f}  peer {p:,.0f}  ratio {o / p:.2f}", file=sys.stderr)
        prompts = workload(nseq, 1)
        seq_reps = 1 if args.quick else 3
        o = median_rate(lambda: seqs_ours(pool, prompts), seq_reps)
        p = median_rate(lambda: seqs_peer(BlockManager(num_blocks, BS), prompts), seq_reps)
        rows.append((f"sequence workload, 1 process ({nseq} seqs, seqs/s)", o, p))
        print(f"seqs 1 proc: kvscope {o:,.0f} peer {p:,.0f}", file=sys.stderr)
    finally:
        pool.close()
        pool.unlink()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    m = median_rate(lambda: seqs_multi(4, prompts, num_blocks), 1 if args.quick else 3)
    rows.append(
        (
            f"sequence workload, 4 processes on {os.cpu_count()} cores (aggregate seqs/s)",
            m,
            float("nan"),
        )
    )
    print("| workload | kvscope | peer (in-process) | kvscope / peer |")
    print("|---|---:|---:|---:|")
    for label, o, p in rows:
        ratio = f"{o / p:.2f}" if p == p else "—"
        peer = f"{p:,.0f}" if p == p else "— (cannot share)"
        print(f"| {label} | {o:,.0f} | {peer} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
