"""A small seeded serving workload on one pool (tests/test_replay.py): requests behind six
shared prompts, appends, publications, forks, frees and aborts, in an order fixed by the seed;
one that takes leases (lease_work), for the lease faults; one run by a forked worker and then
by this process, which reclaims a dead worker's blocks (worker_work: kill-holding-lock kills
the worker); one whose steps read a static padded block table, audited every step
(padded_work: stale-padding-row leaves its padding rows stale); a batched engine that
stores its
K/V with `kvscope.kernels.store_kv`, told its writers (store_work), with a stale slot mapping
on request; and one that samples each request twice and makes the copy-on-write copies
(copy_work), one of them skipped on request.

    python tests/replay_work.py [OPS]      (under `kvscope run --record-ops FILE --inject F`)
    python tests/replay_work.py OPS stale-mapping     (store_work with its bug)
    python tests/replay_work.py OPS late-double-free  (a request held through the workload,
                                                       then freed twice)
"""

from __future__ import annotations

import os
import random
import sys

import numpy as np
import torch

from kvscope.allocator import KVPool, PoolConfig, PoolError, faults
from kvscope.kernels import store_kv
from kvscope.probes.stores import Writers

CONFIG = dict(
    num_blocks=48, block_size=4, num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32"
)


def work(pool: KVPool, n_ops: int, seed: int = 1, sweep: bool = False) -> None:
    """n_ops steps of the workload on `pool` (every request freed at the end); with `sweep`,
    each step ends with the slot-provenance sweep of its live requests (`pool.check_provenance`,
    which the example server's guard mode runs on a schedule of its own)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100) for _ in range(rng.randrange(3, 14))] for _ in range(6)]
    live = []
    for i in range(n_ops):
        if len(live) < 6 and rng.random() < 0.5:
            live.append(pool.allocate(f"r{i}", prompts[rng.randrange(6)] + [i]))
        elif live:
            s = rng.choice(live)
            x = rng.random()
            if x < 0.5:
                pool.mark_computed(s, len(s.tokens))
                pool.append(s, [rng.randrange(100)])
            elif x < 0.6 and len(live) < 6:
                live.append(pool.fork(s, f"f{i}"))
            else:
                live.remove(s)
                (pool.free if x < 0.9 else pool.abort)(s)
        if sweep:
            pool.check_provenance(live)
    for s in live:
        pool.free(s)


def worker_work(pool: KVPool, n_ops: int) -> None:
    """Two processes serving from one pool: a forked worker attached to it (recording into the
    pool's log where it records) runs the workload with the faults armed here, which it takes
    with it (kill-holding-lock kills it in a release, holding its locks); then this process
    runs it (another seed) and reclaims what a dead worker left, as examples/server/worker.py
    does (`pool.reclaim_dead()`)."""
    armed = dict(faults.ARMED)
    faults.ARMED.clear()  # (the worker's: not this process's)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            worker = KVPool.attach(pool.name)
            if pool.recording:
                worker.record_ops(pool.recording)
            faults.ARMED.update(armed)
            work(worker, n_ops)
            worker.close()
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.waitpid(pid, 0)
    work(pool, n_ops, seed=2)
    pool.reclaim_dead()


def padded_work(pool: KVPool, n_steps: int, seed: int = 1) -> None:
    """A seeded engine whose decode steps read one static block table of a fixed number of
    rows, padded with -1 (as examples/server/graphs.py's step graphs do), audited every step
    (`pool.audit_block_table`, as the server's guard mode does); stale-padding-row (its
    opportunity: a step of fewer rows than the last) leaves the padding rows as the earlier,
    larger step wrote them, as the fault does there."""
    rng = random.Random(seed)
    table = np.full((6, 8), -1, dtype=np.int32)
    written = 0
    running: list[list] = []  # [sequence, tokens it still decodes]
    for step in range(n_steps):
        if len(running) < len(table) and (not running or rng.random() < 0.4):
            prompt = [rng.randrange(100) for _ in range(rng.randrange(3, 10))]
            running.append([pool.allocate(f"r{step}", prompt), rng.randrange(2, 8)])
        for s, _ in running:
            pool.append(s, [rng.randrange(100)])
        n = len(running)
        if n < written and faults.opportunity("stale-padding-row"):
            table[:n] = -1  # the fault: the padding rows keep the larger step's block ids
            faults.fired("stale-padding-row")
        else:
            table[:] = -1
            written = n
        for i, (s, _) in enumerate(running):
            table[i, : len(s.block_table)] = s.block_table
        pool.audit_block_table(table, rows=[s for s, _ in running])
        for entry in running:
            entry[1] -= 1
        done = [s for s, left in running if left == 0]
        running = [e for e in running if e[1] > 0]
        for s in done:
            pool.free(s)
    for s, _ in running:
        pool.free(s)


def lease_work(pool: KVPool, n_ops: int, seed: int = 1) -> None:
    """A seeded serving loop with leases, as examples/scenarios' transfer-after-free and
    lease-leak run it: a request that waits for its remote K/V under a write lease (released
    when the receive completes; resumed where a preemption took its blocks meanwhile), or one
    whose finished K/V is offloaded under a read lease taken before its free and released
    after; and every step the sweep for leases past their deadline (the clock's now)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100) for _ in range(rng.randrange(3, 14))] for _ in range(4)]
    for i in range(n_ops // 8):
        s = pool.allocate(f"r{i}", prompts[rng.randrange(4)] + [i])
        if rng.random() < 0.5:
            pool.set_state(s, "waiting")  # its K/V arrives from a prefill worker
            lease = pool.lease(s, "write", holder="kv-receiver", timeout=30)
            lease.release()
            if s.state == "preempted":
                pool.resume(s)
            pool.set_state(s, "running")
        pool.mark_computed(s, len(s.tokens))
        pool.append(s, [rng.randrange(100)])
        offload = pool.lease(s, "read", holder="kv-offload", timeout=30)
        pool.free(s)
        offload.release()
        pool.expire_leases()


def store_work(pool: KVPool, n_steps: int, seed: int = 1, stale: bool = False) -> None:
    """A seeded batched engine: each step admits a request (its prompt's K/V stored) or runs a
    decode step over the running batch (a token appended to each, the batch's slot mapping
    built, then every layer's K/V stored through it), a request finishing after a few tokens.
    Every store is told its writers (Writers). With `stale`, the requests that finish in a step
    are freed as the step is scheduled, after its slot mapping was built and before its K/V is
    stored through it: their tokens land in freed blocks (the store check's use_after_free)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    heads, dim, bs = CONFIG["num_kv_heads"], CONFIG["head_dim"], pool.block_size

    def store(spans: list, slots: list[int]) -> None:
        k = torch.randn(len(slots), heads, dim, generator=gen)
        mapping = torch.tensor(slots, dtype=torch.int64)
        writers = Writers(pool, spans)
        for layer in range(CONFIG["num_layers"]):
            kc, vc = pool.kv[layer, 0], pool.kv[layer, 1]
            store_kv(k, -k, kc, vc, mapping, block_size=bs, writers=writers)

    running: list[list] = []  # [sequence, tokens it still decodes]
    for step in range(n_steps):
        if len(running) < 4 and (not running or rng.random() < 0.4):
            s = pool.allocate(f"r{step}", [rng.randrange(100) for _ in range(rng.randrange(3, 10))])
            n = len(s.tokens)
            store([(s, 0, n)], pool.slot_mapping(s, 0, n))
            pool.mark_computed(s, n)
            running.append([s, rng.randrange(2, 6)])
            continue
        for s, _ in running:
            pool.append(s, [rng.randrange(100)])
        spans = [(s, len(s.tokens) - 1, len(s.tokens)) for s, _ in running]
        slots = [x for s, a, b in spans for x in pool.slot_mapping(s, a, b)]
        for entry in running:
            entry[1] -= 1
        done = [e for e in running if e[1] == 0]
        running = [e for e in running if e[1] > 0]
        if stale:
            for s, _ in done:  # the bug: freed before the step's store, not after
                pool.free(s)
        store(spans, slots)
        if not stale:
            for s, _ in done:
                pool.free(s)
    for s, _ in running:
        pool.free(s)


def copy_work(pool: KVPool, n_requests: int = 6, skip: int = -1, tell: bool = True) -> None:
    """An engine that samples each request twice: its prompt's K/V stored (told its writers),
    published, the request forked, then decode steps on both samples, each step's
    copy-on-write copies made with `kvscope.kernels.copy_blocks` (told the pool, with `tell`)
    before its token's K/V is stored; every request freed at the end. With `skip` (a request's
    number), that request's first copy is skipped (the bug: its new block holds none of the
    positions before the token stored next). On a CUDA pool each store's slot mapping is built
    on the host and checked there (`Writers.check`), the store given it on the device."""
    from kvscope.kernels import copy_blocks

    rng = random.Random(3)
    heads, dim, bs = CONFIG["num_kv_heads"], CONFIG["head_dim"], pool.block_size
    system = [rng.randrange(100) for _ in range(9)]
    dev = pool.kv.device

    def store(seq, start: int, end: int) -> None:
        pos = torch.arange(start, end, dtype=torch.float32)
        tok = torch.tensor(seq.tokens[start:end], dtype=torch.float32)
        k = (tok * 0.01 + pos * 0.1)[:, None, None].expand(-1, heads, dim).contiguous()
        mapping = torch.tensor(pool.slot_mapping(seq, start, end), dtype=torch.int64)
        writers = Writers(pool, [(seq, start, end)])
        if dev.type != "cpu":
            writers.check(mapping)  # (on the host: its STORE record is whole at the store)
            k, mapping, writers = k.to(dev), mapping.to(dev), None
        for layer in range(CONFIG["num_layers"]):
            kc, vc = pool.kv[layer, 0], pool.kv[layer, 1]
            store_kv(k, -k, kc, vc, mapping, block_size=bs, writers=writers)

    for i in range(n_requests):
        s = pool.allocate(f"r{i}", system + [rng.randrange(100) for _ in range(i % 3 + 1)])
        store(s, s.num_cached_tokens, len(s.tokens))
        pool.mark_computed(s, len(s.tokens))
        samples = [s, pool.fork(s, f"r{i}#1")]
        skipped = False
        for _ in range(3):
            for q in samples:
                copies = pool.append(q, [rng.randrange(100)])
                if copies and i == skip and not skipped:
                    copies, skipped = [], True  # the bug
                if copies:
                    pairs = torch.tensor(copies, dtype=torch.int64)
                    copy_blocks(pool.kv, pairs[:, 0], pairs[:, 1], pool=pool if tell else None)
                store(q, len(q.tokens) - 1, len(q.tokens))
        for q in samples:
            pool.free(q)


if __name__ == "__main__":
    pool = KVPool.create(f"work-{os.getpid()}", PoolConfig(**CONFIG))
    try:
        n = int(sys.argv[1]) if len(sys.argv) > 1 else 400
        if sys.argv[2:] == ["stale-mapping"]:
            store_work(pool, n, stale=True)
        elif sys.argv[2:] == ["late-double-free"]:
            victim = pool.allocate("victim", [7, 7, 7, 7, 7])
            work(pool, n)
            pool.free(victim)
            try:
                pool.free(victim)  # the bug
            except PoolError as e:
                print("PoolError:", e)
        else:
            work(pool, n)
    finally:
        pool.close()
        pool.unlink()
