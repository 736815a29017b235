"""Pool throughput: kvscope's shared, journaled KVPool beside nano-vllm's BlockManager and vLLM's
v1 BlockPool, the same workloads in the same run.

    python bench/bench_pool.py --nano-vllm DIR --vllm DIR   # all three, 10-20 minutes
    python bench/bench_pool.py --quick                      # kvscope alone, small: a smoke test
    python bench/bench_pool.py --procs --repeat 5           # 1 and 4 processes in turn, 5 rounds
    perf stat -e task-clock,context-switches python bench/bench_pool.py --once 4
                                # the sequence workload once, in 4 processes: for a profiler

The peers are not part of kvscope; each is installed for the run and driven through its own
methods (bench/peer_nanovllm.py and bench/peer_vllm.py say how, and which calls stand for
which operation):

    git clone https://github.com/GeeeekExplorer/nano-vllm /tmp/nano-vllm
    pip install xxhash
    pip install --no-deps --target /tmp/vllm-peer vllm==0.33.0 -r bench/vllm_import_deps.txt
    python bench/bench_pool.py --nano-vllm /tmp/nano-vllm --vllm /tmp/vllm-peer

A peer left out is not measured; an operation a peer has no equivalent of is n/a. One core
pinned, GC off; each workload gets a fresh pool per contender and one untimed warm-up run each
(the first runs after a pool is made measure slow), then --repeat rounds that take the
contenders in turn; the table has the medians, stderr every run.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import resource
import statistics
import struct
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import peer_nanovllm  # noqa: E402
import peer_vllm  # noqa: E402

from kvscope.allocator import KVPool, PoolConfig  # noqa: E402

BS = 16
NUM_BLOCKS = 64 * 1024
DECODE = 64
RUNNING = 64
# iterations of the plain loop procs_rounds times beside the pool (about 0.3 s on one core)
LOOP = 10_000_000


def new_pool(num_blocks: int) -> KVPool:
    cfg = PoolConfig(num_blocks=num_blocks, block_size=BS, num_layers=1, num_kv_heads=1, head_dim=8)
    return KVPool.create(f"bench-{uuid.uuid4().hex[:8]}", cfg)


class KvscopePool:
    """A KVPool handle, with a workload per method (rates per second)."""

    name = "kvscope"

    def __init__(self, pool: KVPool):
        self.pool = pool

    def batch(self, n: int, tokens: list[int]) -> float:
        pool = self.pool
        t = time.perf_counter()
        for i in range(n):
            tokens[0] = i  # a new prompt each time: no prefix hits
            pool.free(pool.allocate("b", tokens))
        return 64 * n / (time.perf_counter() - t)

    def single(self, n: int) -> float:
        pool = self.pool
        t = time.perf_counter()
        for i in range(n):
            pool.free(pool.allocate("s", [i, 1, 2]))
        return n / (time.perf_counter() - t)

    def append(self, n: int) -> float:
        # One token at a time; a fresh sequence every 1024 tokens (64 blocks).
        pool = self.pool
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

    def fork(self, n: int) -> float:
        pool = self.pool
        seq = pool.allocate("f", list(range(16 * BS)))
        t = time.perf_counter()
        for _ in range(n):
            pool.free(pool.fork(seq, "c"))
        rate = n / (time.perf_counter() - t)
        pool.free(seq)
        return rate

    def hit(self, n: int, prompt: list[int]) -> float:
        pool = self.pool
        owner = pool.allocate("p", prompt)
        pool.mark_computed(owner, len(prompt))
        expect = (len(prompt) - 1) // BS * BS
        t = time.perf_counter()
        for _ in range(n):
            seq = pool.allocate("h", prompt)
            assert seq.num_cached_tokens == expect
            pool.free(seq)
        rate = n / (time.perf_counter() - t)
        pool.free(owner)
        return rate

    def seqs(self, prompts: list[list[int]], decode: int, running: int) -> float:
        pool = self.pool
        t = time.perf_counter()
        live: list[list[Any]] = []
        pending = iter(prompts)
        done = 0
        tok = 0
        while done < len(prompts):
            while len(live) < running:
                p = next(pending, None)
                if p is None:
                    break
                seq = pool.allocate("w", p)
                pool.mark_computed(seq, len(p))
                live.append([seq, decode])
            for item in live:
                seq = item[0]
                tok += 1
                pool.append(seq, [tok])
                if seq.num_tokens % BS == 0:
                    pool.mark_computed(seq, seq.num_tokens)
                item[1] -= 1
            for item in [x for x in live if x[1] == 0]:
                pool.free(item[0])
                live.remove(item)
                done += 1
        return len(prompts) / (time.perf_counter() - t)

    def close(self) -> None:
        self.pool.close()
        self.pool.unlink()


def workload(num_seqs: int, seed: int) -> list[list[int]]:
    """Prompts of 40-200 tokens; 70% behind one of 10 shared 256-token system prompts."""
    rng = random.Random(seed)
    systems = [[rng.randrange(30000) for _ in range(256)] for _ in range(10)]
    out = []
    for _ in range(num_seqs):
        own = [rng.randrange(30000) for _ in range(rng.randint(40, 200))]
        out.append(rng.choice(systems) + own if rng.random() < 0.7 else own)
    return out


def seqs_multi(
    num_procs: int,
    prompts: list[list[int]],
    num_blocks: int,
    cpu: list[float] | None = None,
    lru: list[tuple[int, int]] | None = None,
    switches: list[tuple[int, int]] | None = None,
    locks: dict[str, tuple[int, int, int, int]] | None = None,
) -> float:
    """Aggregate sequences/s of num_procs processes sharing one pool, from the start signal to
    the last process's end of its share (its close and exit are not timed, as the one-process
    figure times neither). Each process copies its share of the prompts before the start: a
    forked child's first writes to its parent's objects (their reference counts) would copy the
    pages they lie on inside the timed part, which the one-process figure does not pay. The
    CPU seconds (user + system) the processes used in the timed part are appended to `cpu` when
    given, the pool's LRU-list counters (evictions that scanned the block records,
    evictions served from the list) to `lru`, and the processes' voluntary and involuntary
    context switches in the timed part (all of them together) to `switches`; `locks` gets
    each lock the run took: acquisitions, contended ones, wait and hold ns (its record)."""
    pool = new_pool(num_blocks)
    ready_r, ready_w = os.pipe()
    start_r, start_w = os.pipe()
    done_r, done_w = os.pipe()
    pids = []
    share = len(prompts) // num_procs
    for k in range(num_procs):
        pid = os.fork()
        if pid == 0:
            for fd in (ready_r, start_w, done_r):
                os.close(fd)
            mine = KvscopePool(KVPool.attach(pool.name))
            own = [list(p) for p in prompts[k * share : (k + 1) * share]]
            os.write(ready_w, b"r")
            os.read(start_r, 1)  # start together
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            mine.seqs(own, DECODE, RUNNING // num_procs)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            used = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
            vol, invol = r1.ru_nvcsw - r0.ru_nvcsw, r1.ru_nivcsw - r0.ru_nivcsw
            os.write(done_w, _DONE.pack(used, vol, invol))
            mine.pool.close()
            os._exit(0)
        pids.append(pid)
    for fd in (ready_w, start_r, done_w):
        os.close(fd)
    _read_exactly(ready_r, num_procs)
    t = time.perf_counter()
    os.write(start_w, b"x" * num_procs)
    done = _read_exactly(done_r, num_procs * _DONE.size)
    rate = share * num_procs / (time.perf_counter() - t)
    for p in pids:
        os.waitpid(p, 0)
    for fd in (ready_r, start_w, done_r):
        os.close(fd)
    each = list(_DONE.iter_unpack(done))
    if cpu is not None:
        cpu.append(sum(u for u, _, _ in each))
    if switches is not None:
        switches.append((sum(v for _, v, _ in each), sum(i for _, _, i in each)))
    if locks is not None:
        t = pool.locks
        for i, name in enumerate(t.names):
            if t.num_acquires[i]:
                locks[name] = tuple(
                    int(col[i]) for col in (t.num_acquires, t.num_contended, t.wait_ns, t.hold_ns)
                )
    if lru is not None:
        h = pool.view.lru_header[0]
        lru.append((int(h["scans"]), int(h["takes"])))
    pool.close()
    pool.unlink()
    return rate


_DONE = struct.Struct("dqq")


def _read_exactly(fd: int, size: int) -> bytes:
    """size bytes from a pipe the benchmark's processes write; SystemExit where one of them
    ended before writing its part."""
    got = b""
    while len(got) < size:
        part = os.read(fd, size - len(got))
        if not part:
            raise SystemExit("bench_pool: error: a worker process ended early")
        got += part
    return got


def loop_rate(num_procs: int, n: int) -> float:
    """Iterations/s of a plain Python loop of n iterations split over num_procs processes (no
    pool): what the machine gives several processes against one, in the same conditions."""
    ready_r, ready_w = os.pipe()
    start_r, start_w = os.pipe()
    pids = []
    for _ in range(num_procs):
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            os.close(start_w)
            os.write(ready_w, b"r")
            os.read(start_r, 1)
            x = 0
            for i in range(n // num_procs):
                x += i
            os._exit(0)
        pids.append(pid)
    os.close(ready_w)
    os.close(start_r)
    _read_exactly(ready_r, num_procs)
    t = time.perf_counter()
    os.write(start_w, b"x" * num_procs)
    for p in pids:
        os.waitpid(p, 0)
    rate = n / (time.perf_counter() - t)
    os.close(ready_r)
    os.close(start_w)
    return rate


def measure(
    makers: dict[str, Callable[[], Any]], method: str, args: tuple[Any, ...], reps: int, label: str
) -> dict[str, float | None]:
    """Median rate per contender; None where the contender has no such operation."""
    made = {name: make() for name, make in makers.items()}
    try:
        runs: dict[str, list[float]] = {}
        fns = {n: getattr(c, method) for n, c in made.items() if hasattr(c, method)}
        for fn in fns.values():
            fn(*args)  # warm-up
        for _ in range(reps):
            for name, fn in fns.items():
                runs.setdefault(name, []).append(fn(*args))
    finally:
        for contender in made.values():
            contender.close()
    for name, rates in runs.items():
        shown = " ".join(f"{r:,.0f}" for r in rates)
        print(f"{label} | {name}: {shown}", file=sys.stderr)
    return {name: statistics.median(runs[name]) if name in runs else None for name in makers}


def procs_rounds(nseq: int, rounds: int) -> int:
    """The sequence workload in one process (pinned to one core, as in the table) and in 4
    processes sharing a pool, taken in turn; medians and the spread of the per-round ratios, and
    the CPU seconds each used (which a loaded machine's share of the cores does not change).
    Each round also times a plain Python loop (no pool) the same ways: its ratio is what the
    machine gives 4 processes against one in that round (about 2x on a quiet 2-core machine;
    on a loaded one the scheduler gives the processes of one session, which share an autogroup,
    about what it gives one process: there no pool can do better)."""
    prompts = workload(nseq, 1)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
    gc.collect()
    gc.disable()
    one_rates, multi_rates, ratios, one_cpu, multi_cpu, loops = [], [], [], [], [], []
    for r in range(rounds + 1):
        if cores:
            os.sched_setaffinity(0, {cores[0]})
        contender = KvscopePool(new_pool(NUM_BLOCKS))
        try:
            c0 = time.process_time()
            one = contender.seqs(prompts, DECODE, RUNNING)
            one_cpu.append(time.process_time() - c0)
        finally:
            contender.close()
        loop_one = loop_rate(1, LOOP)
        if cores:
            os.sched_setaffinity(0, set(cores))
        lru: list[tuple[int, int]] = []
        sw: list[tuple[int, int]] = []
        multi = seqs_multi(4, prompts, NUM_BLOCKS, multi_cpu, lru, sw)
        loop = loop_rate(4, LOOP) / loop_one
        load = os.getloadavg()[0]
        what = "warm-up" if r == 0 else f"round {r}"
        print(
            f"{what}: 1 process {one:,.0f}, 4 processes {multi:,.0f} seqs/s, "
            f"{multi / one:.2f}x (a Python loop {loop:.2f}x); CPU {one_cpu[-1]:.2f} s, "
            f"{multi_cpu[-1]:.2f} s (load average {load:.2f}); 4 processes' evictions: "
            f"{lru[0][0]} scans, {lru[0][1]} from the shared LRU list; their context switches "
            f"{sw[0][0]} voluntary, {sw[0][1]} involuntary",
            file=sys.stderr,
        )
        if r == 0:
            one_cpu.pop()
            multi_cpu.pop()
        else:
            one_rates.append(one)
            multi_rates.append(multi)
            ratios.append(multi / one)
            loops.append(loop)
    print(f"| sequence workload ({nseq:,} seqs) | seqs/s, median of {rounds} | range |")
    print("|---|---:|---:|")
    for label, rates in (
        ("1 process", one_rates),
        (f"4 processes on {len(cores) or os.cpu_count()} cores", multi_rates),
    ):
        print(
            f"| {label} | {statistics.median(rates):,.0f} | {min(rates):,.0f}-{max(rates):,.0f} |"
        )
    for label, xs in (
        ("4 processes / 1", ratios),
        ("CPU seconds, 4 processes / 1", [m / o for m, o in zip(multi_cpu, one_cpu)]),
        ("a Python loop without the pool, 4 processes / 1", loops),
    ):
        print(f"| {label} | {statistics.median(xs):.2f}x | {min(xs):.2f}-{max(xs):.2f}x |")
    return 0


def once(num_procs: int, nseq: int) -> int:
    """The sequence workload once, in num_procs processes sharing one pool (forked: one process
    too), for a profiler run around it (`perf stat`, `perf record -g`, `strace -c -f`): their
    aggregate seqs/s, CPU seconds and context switches per sequence in the timed part, and
    each pool lock's acquisitions, contended ones and wait and hold time (the lock records)."""
    prompts = workload(nseq, 1)
    gc.collect()
    gc.disable()
    cpu: list[float] = []
    switches: list[tuple[int, int]] = []
    locks: dict[str, tuple[int, int, int, int]] = {}
    rate = seqs_multi(num_procs, prompts, NUM_BLOCKS, cpu, None, switches, locks)
    done = nseq // num_procs * num_procs
    vol, invol = switches[0]
    print(
        f"{num_procs} process(es), {done:,} seqs: {rate:,.0f} seqs/s; CPU {cpu[0]:.3f} s "
        f"({cpu[0] / done * 1e6:.1f} us a sequence); context switches {vol} voluntary, "
        f"{invol} involuntary ({(vol + invol) / done:.4f} a sequence); load average "
        f"{os.getloadavg()[0]:.2f}"
    )
    print("| lock | acquisitions | contended | wait, ms | hold, ms |")
    print("|---|---:|---:|---:|---:|")
    for name, (acq, cont, wait, hold) in locks.items():
        print(f"| {name} | {acq:,} | {cont:,} | {wait / 1e6:.1f} | {hold / 1e6:.1f} |")
    return 0


def fmt(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate:,.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small workloads (smoke test)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seqs", type=int, default=10_000, help="sequences in the sequence workload")
    ap.add_argument("--nano-vllm", metavar="DIR", help="a nano-vllm checkout to measure beside")
    ap.add_argument("--vllm", metavar="DIR", help="a pip --target folder holding vllm")
    ap.add_argument(
        "--procs",
        action="store_true",
        help="kvscope's sequence workload alone: one process and 4 processes taken in turn, "
        "--repeat rounds (each round's pair, ratio and load average on stderr)",
    )
    ap.add_argument(
        "--once",
        type=int,
        metavar="N",
        help="the sequence workload once, in N processes sharing one pool (1 too: a forked "
        "child), for a profiler: CPU and context switches a sequence, the lock records",
    )
    args = ap.parse_args(argv)
    if args.once is not None:
        if args.once < 1:
            ap.error("--once needs a number of processes of at least 1")
        return once(args.once, args.seqs)
    if args.procs:
        return procs_rounds(args.seqs, args.repeat)
    scale = 0.1 if args.quick else 1.0
    reps = 1 if args.quick else args.repeat
    nseq = max(200, int(args.seqs * scale))

    makers: dict[str, Callable[[], Any]] = {"kvscope": lambda: KvscopePool(new_pool(NUM_BLOCKS))}
    if args.nano_vllm:
        nano, commit = peer_nanovllm.load(args.nano_vllm)
        print(f"nano-vllm at {commit}", file=sys.stderr)
        makers["nano-vllm"] = lambda: peer_nanovllm.NanoVllmPeer(nano, NUM_BLOCKS, BS)
    if args.vllm:
        t = time.perf_counter()
        block_pool, utils, version = peer_vllm.load(args.vllm)
        print(f"vllm {version}, imported in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        makers["vLLM BlockPool"] = lambda: peer_vllm.VllmPeer((block_pool, utils), NUM_BLOCKS, BS)

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    gc.collect()
    gc.disable()
    random.seed(0)
    batch_tokens = [random.randrange(30000) for _ in range(64 * BS)]
    hit_prompt = list(range(16 * BS + 1))
    micro: list[tuple[str, str, tuple[Any, ...]]] = [
        ("allocate+free, batches of 64 (blocks/s)", "batch", (int(2000 * scale), batch_tokens)),
        ("allocate+free, single pairs (pairs/s)", "single", (int(20000 * scale),)),
        ("append one token (appends/s)", "append", (int(50000 * scale),)),
        ("fork+free of 16 blocks (forks/s)", "fork", (int(5000 * scale),)),
        ("prefix hit of 16 blocks (allocs/s)", "hit", (int(5000 * scale), hit_prompt)),
    ]
    rows = [(label, measure(makers, m, a, reps, label)) for label, m, a in micro]
    prompts = workload(nseq, 1)
    label = f"sequence workload, 1 process ({nseq:,} seqs, seqs/s)"
    seq_reps = 1 if args.quick else 3
    rows.append((label, measure(makers, "seqs", (prompts, DECODE, RUNNING), seq_reps, label)))

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    multi = statistics.median(
        seqs_multi(4, prompts, NUM_BLOCKS) for _ in range(1 if args.quick else 3)
    )
    label = f"sequence workload, 4 processes on {os.cpu_count()} cores (aggregate seqs/s)"
    rows.append((label, {"kvscope": multi}))

    peers = [name for name in makers if name != "kvscope"]
    head = ["workload", "kvscope", *peers, *(f"kvscope / {p}" for p in peers)]
    print("| " + " | ".join(head) + " |")
    print("|---|" + "---:|" * (len(head) - 1))
    for label, rates in rows:
        ours = rates["kvscope"]
        cells = [label, fmt(ours)]
        cells += ["— (one process only)" if p not in rates else fmt(rates[p]) for p in peers]
        for p in peers:
            theirs = rates.get(p)
            cells.append(f"{ours / theirs:.2f}" if ours and theirs else "n/a")
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
