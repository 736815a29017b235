"""A snapshot's cost (docs/REPLAY.md "Starting from a snapshot", "A bounded log"): how long a
SNAPSHOT of a pool takes and how large it is, and what bounding the log costs the serving loop.

    python bench/bench_checkpoint.py
    python bench/bench_checkpoint.py --blocks 4096 32768 --steps 100000

For each pool size (--blocks, block size 16, 256 sequence slots, 128 live sequences of which 64
published), the time of allocator/checkpoint.py `take` (the consistent copy of the metadata and
its compression) and `write` (the same and the core writing the record: the pause a checkpoint
makes in the operation that takes it), as min, median and max of --repeat, and the record's size;
then tests/replay_work.py's workload of --steps steps recorded unbounded and with each --limit,
the seconds (wall clock, min of --repeat), the checkpoints taken, the file's size and its bytes
on disk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvscope.allocator import KVPool, PoolConfig, checkpoint  # noqa: E402
from tests.replay_work import CONFIG, work  # noqa: E402


def snapshot_cost(blocks: int, repeat: int, tmp: str) -> None:
    cfg = PoolConfig(
        num_blocks=blocks,
        block_size=16,
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        dtype="float32",
        max_seqs=256,
    )
    pool = KVPool.create(f"bench-ckpt-{os.getpid()}-{blocks}", cfg)
    path = os.path.join(tmp, f"s{blocks}.ops")
    try:
        per = max(1, blocks // 512)
        seqs = [pool.allocate(f"r{i}", list(range(i, i + 16 * per))) for i in range(128)]
        for s in seqs[:64]:
            pool.mark_computed(s, len(s.tokens))
        pool.record_ops(path)
        start = {"bench": True}
        took, wrote, size = [], [], 0
        for _ in range(repeat):
            t0 = time.perf_counter()
            got = checkpoint.take(pool, start)
            took.append(time.perf_counter() - t0)
            assert got is not None
            size = len(got[0])
            t0 = time.perf_counter()
            checkpoint.write(pool, start)
            wrote.append(time.perf_counter() - t0)
        pool.stop_recording()
        seg = pool.view.offsets["end"]
    finally:
        pool.close()
        pool.unlink()

    def ms(v: list[float]) -> str:
        return f"{min(v) * 1e3:.2f} / {statistics.median(v) * 1e3:.2f} / {max(v) * 1e3:.2f}"

    print(
        f"{blocks:>7} blocks  segment {seg:>10} B  snapshot {size:>8} B  "
        f"take {ms(took)} ms  write {ms(wrote)} ms (min / median / max)"
    )


def ring_cost(limit: int, steps: int, repeat: int, tmp: str) -> None:
    path = os.path.join(tmp, "ring.ops")
    times = []
    for _ in range(repeat):
        if os.path.exists(path):
            os.unlink(path)
        pool = KVPool.create(f"bench-ring-{os.getpid()}", PoolConfig(**CONFIG))
        try:
            pool.record_ops(path, limit=limit)
            t0 = time.perf_counter()
            work(pool, steps)
            times.append(time.perf_counter() - t0)
            made = pool.checkpoints
        finally:
            pool.close()
            pool.unlink()
    st = os.stat(path)
    print(
        f"limit {limit:>9}  {steps} steps {min(times):.3f} s (min of {repeat})  "
        f"checkpoints {made}  file {st.st_size} B  on disk {st.st_blocks * 512} B"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--blocks", type=int, nargs="+", default=[768, 4096, 32768])
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--limit", type=int, nargs="+", default=[1 << 20, 64 << 10])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for b in args.blocks:
            snapshot_cost(b, args.repeat, tmp)
        for limit in [0, *args.limit]:
            ring_cost(limit, args.steps, args.repeat, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
