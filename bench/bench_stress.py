"""Many processes, hostile neighbours: workers on one pool, a killer, concurrent reclaimers.

    python bench/bench_stress.py                  # 120 s
    python bench/bench_stress.py --seconds 20     # shorter

Workers run a serving mix on one pool (shared prefixes, appends with copy-on-write, fork,
free/abort, waiting sequences that get preempted and resumed, eviction pressure, now and then
a close and re-attach), checking before every free that the pool's sequence table, the stored
token ids and the K/V read through the block table are still their own. The parent SIGKILLs a
random worker every 0.2-2 s and starts another; two reclaimer processes call `reclaim_dead()`
at random moments, a third process runs `kvscope check --repair` every second or so, and the
parent runs `kvscope analyze` on the live pool. At the end every worker is killed, the pool is
reclaimed once more and checked. Prints kills, operations, corruptions (seen by workers, and
errors of the final check), blocks lost, and the live analyses (how long, how many consistent,
errors in consistent ones). tests/test_pool_stress.py runs a short form.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import mmap
import os
import random
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from kvscope.allocator import KVPool, PoolConfig, PoolExhausted
from kvscope.allocator.layout import SeqState

BS = 4
NUM_BLOCKS = 512
SYSTEM_PROMPTS = [[100 + i] * 8 + [i, i + 1, i + 2, i + 3] for i in range(6)]
MAX_LIVE = 12
# Per worker slot: operations, corruptions (shared memory the workers add to).
OPS, CORRUPT = 0, 1


class Worker:
    """One worker process's serving loop and its checks of its own sequences."""

    def __init__(self, name: str, seed: int, counters: np.ndarray):
        self.name, self.rng, self.counters = name, random.Random(seed), counters
        self.pool = KVPool.attach(name)
        self.live: list[Any] = []

    def corrupt(self, why: str) -> None:
        print(f"worker pid {os.getpid()}: {why}", file=sys.stderr, flush=True)
        self.counters[CORRUPT] += 1

    def write(self, seq: Any, start: int) -> None:
        """K/V for positions start.. (a value that depends on the whole prefix, like real KV),
        then publish them."""
        kv, tokens, table = self.pool.kv, seq.tokens, seq.block_table
        v = 0
        for p, t in enumerate(tokens):
            v = (v * 31 + t + 1) % 65521
            if p >= start:
                kv[0, 0, table[p // BS], p % BS, 0, 0] = float(v)
        self.pool.mark_computed(seq, seq.num_tokens)

    def verify(self, seq: Any) -> bool:
        """The pool still holds this sequence as this process knows it (table, tokens, K/V)."""
        if seq.state == "preempted":
            return True
        pool = self.pool
        row = pool.view.seqs[seq.slot]
        table = row["table"][: int(row["num_blocks"])].tolist()
        if int(row["state"]) == SeqState.EMPTY or int(row["owner_pid"]) != os.getpid():
            self.corrupt(f"{seq.request_id}: its slot {seq.slot} was taken from it")
            return False
        if table != seq.block_table:
            self.corrupt(f"{seq.request_id}: pool table {table} != handle table {seq.block_table}")
            return False
        stored = pool.view.blocks["tokens"]
        for j, b in enumerate(table):
            want = seq.tokens[j * BS : (j + 1) * BS]
            if len(want) == BS and stored[b].tolist() != want:
                self.corrupt(f"{seq.request_id}: block {b} holds tokens of another prompt")
                return False
        kv, v = pool.kv, 0
        for p, t in enumerate(seq.tokens):
            v = (v * 31 + t + 1) % 65521
            if float(kv[0, 0, table[p // BS], p % BS, 0, 0]) != float(v):
                self.corrupt(f"{seq.request_id}: position {p} reads another prompt's K/V")
                return False
        return True

    def end(self, seq: Any) -> None:
        self.verify(seq)
        if self.rng.random() < 0.2:
            self.pool.abort(seq)
        else:
            self.pool.free(seq)

    def step(self, i: int) -> None:
        pool, rng, live = self.pool, self.rng, self.live
        r = rng.random()
        if r < 0.005:
            for seq in live:
                self.end(seq)
            live.clear()
            pool.close()
            self.pool = KVPool.attach(self.name)
            return
        if r < 0.3 or not live:
            prompt = rng.choice(SYSTEM_PROMPTS) + [
                rng.randrange(50) for _ in range(rng.randrange(1, 9))
            ]
            seq = pool.allocate(f"{os.getpid()}-{i}", prompt)
            self.write(seq, seq.num_cached_tokens)
            live.append(seq)
            return
        seq = rng.choice(live)
        if seq.state == "preempted":
            pool.resume(seq)
            self.write(seq, seq.num_cached_tokens)
        elif r < 0.6:
            start = seq.num_tokens
            for src, dst in pool.append(
                seq, [rng.randrange(50) for _ in range(rng.randrange(1, 4))]
            ):
                pool.kv[:, :, dst] = pool.kv[:, :, src]
            self.write(seq, start)
        elif r < 0.67 and len(live) < MAX_LIVE:
            live.append(pool.fork(seq, f"{os.getpid()}-f{i}"))
        elif r < 0.71:
            pool.set_state(seq, "waiting" if seq.state == "running" else "running")
        elif r < 0.73:
            pool.evict(rng.randrange(1, 4))
        else:
            live.remove(seq)
            self.end(seq)

    def run(self) -> None:
        for i in range(10**9):
            try:
                self.step(i)
            except PoolExhausted:
                if self.live:
                    self.end(self.live.pop(0))
            self.counters[OPS] += 1
            if i % 64 == 0:
                for seq in self.live:
                    self.verify(seq)


def _child(fn: Callable[[], None]) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        fn()
    except BaseException:
        traceback.print_exc()
        code = 1
    os._exit(code)


def _reclaimer(name: str, seed: int) -> None:
    rng = random.Random(seed)
    pool = KVPool.attach(name)
    while True:
        time.sleep(rng.uniform(0.02, 0.3))
        pool.reclaim_dead()


def _repair(name: str) -> None:
    from kvscope.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        main(["check", name, "--repair"])


def _analyze_live(name: str) -> tuple[float, bool, int]:
    """(seconds, consistent, error findings) of one `kvscope analyze NAME --json`."""
    from kvscope.analysis import analyze_view
    from kvscope.target import read_live

    t0 = time.perf_counter()
    rep = analyze_view(read_live(name))
    errors = sum(f["severity"] == "error" for f in rep["findings"])
    if errors and rep["pool"]["consistent"]:
        for f in rep["findings"]:
            if f["severity"] == "error":
                print(
                    f"live analyze: {f['kind']} block {f['block']}: {f['message']}", file=sys.stderr
                )
    return time.perf_counter() - t0, rep["pool"]["consistent"], errors


def stress(seconds: float, *, workers: int = 5, seed: int = 0) -> dict[str, Any]:
    """Run the stress for `seconds` on a fresh pool; the figures of the run."""
    rng = random.Random(seed)
    name = f"stress-{uuid.uuid4().hex[:8]}"
    cfg = PoolConfig(
        num_blocks=NUM_BLOCKS,
        block_size=BS,
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
        dtype="float32",
        max_clients=16,
        max_seqs=512,
        local_cache_size=4,
    )
    pool = KVPool.create(name, cfg)
    shm = mmap.mmap(-1, 8 * 2 * workers)
    counters = np.frombuffer(shm, np.int64).reshape(workers, 2)
    out: dict[str, Any] = {"kills": 0, "repairs": 0, "analyses": [], "worker_exits": 0}

    def kill(pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        status = os.waitpid(pid, 0)[1]
        # A worker that ended by itself raised (its traceback is on stderr).
        out["worker_exits"] += not os.WIFSIGNALED(status)

    def spawn(w: int) -> int:
        return _child(lambda: Worker(name, rng.randrange(1 << 30), counters[w]).run())

    try:
        pids = [spawn(w) for w in range(workers)]
        helpers = [_child(lambda s=s: _reclaimer(name, s)) for s in (1, 2)]
        end = time.monotonic() + seconds
        next_kill = time.monotonic() + rng.uniform(0.2, 2.0)
        next_repair = time.monotonic() + rng.uniform(0.5, 1.5)
        repairing = 0
        while time.monotonic() < end:
            time.sleep(0.05)
            now = time.monotonic()
            if now >= next_kill:
                w = rng.randrange(workers)
                kill(pids[w])
                pids[w] = spawn(w)
                out["kills"] += 1
                next_kill = now + rng.uniform(0.2, 2.0)
            if now >= next_repair:
                if repairing and os.waitpid(repairing, os.WNOHANG)[0]:
                    repairing = 0
                if not repairing:
                    repairing = _child(lambda: _repair(name))
                    out["repairs"] += 1
                next_repair = now + rng.uniform(0.5, 1.5)
                out["analyses"].append(_analyze_live(name))
        for pid in pids + helpers:
            kill(pid)
        if repairing:
            os.waitpid(repairing, 0)
        pool.reclaim_dead()
        findings = pool.check()
        st = pool.stats()
        out.update(
            operations=int(counters[:, OPS].sum()),
            corruptions=int(counters[:, CORRUPT].sum()),
            check=[f.line() for f in findings],
            # Every process is gone and reclaimed: a block neither free nor cached is lost.
            blocks_lost=NUM_BLOCKS - (st["num_free"] + st["num_cached"] + st["num_local"]),
        )
    finally:
        pool.close()
        pool.unlink()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--workers", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(
        "| seconds | kills | operations | corruptions | blocks lost | workers failed "
        "| live analyses (consistent) | analyze median / max s | errors in consistent analyses |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    r = stress(args.seconds, workers=args.workers, seed=args.seed)
    an = r["analyses"]
    times = sorted(s for s, _, _ in an)
    consistent = sum(c for _, c, _ in an)
    errors = sum(e for _, c, e in an if c)
    corruptions = r["corruptions"] + len(r["check"])
    print(
        f"| {args.seconds:.0f} "
        f"| {r['kills']} | {r['operations']:,} | {corruptions} | {r['blocks_lost']} "
        f"| {r['worker_exits']} | {len(an)} ({consistent}) "
        f"| {times[len(times) // 2]:.2f} / {times[-1]:.2f} | {errors} |",
        flush=True,
    )
    for line in r["check"]:
        print("   ", line)


if __name__ == "__main__":
    main()
