"""What a CUDA pool's operations cost the host, probes off and with every probe `kvscope run`
switches on, and what each of the probes' checks of the K/V costs alone (docs/BENCHMARKS.md,
"Probes on a CUDA pool").

    python bench/bench_pool_cuda.py          # on a CUDA machine, about 15 s

The GPU is kept busy while the host works (a sleep kernel queued before each call, the stream
drained every 8 calls), as in a serving loop, where an operation runs while the step's forward
is still on the GPU: a check that made the host wait would show as the sleep's length. Each
figure is the median host time of one call over 200-300 calls (the first fifth left out).
Geometry: bench_serve.py's model (8 layers, 4 KV heads of 64, fp16), 16-token blocks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

PROBES = ("DIGEST", "MAGIC", "OWNERSHIP", "LEAKS", "EVENTS")


def busy(
    torch,
    fn: Callable[[int], object],
    n: int = 300,
    every: int = 8,
    before: Callable[[int], object] = lambda i: None,
    after: Callable[[int], object] = lambda i: None,
) -> float:
    """Median host microseconds of fn(i) with the GPU busy (`before(i)` and `after(i)` around
    it, untimed)."""
    times = []
    for i in range(n):
        before(i)
        torch.cuda._sleep(60000)
        t = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t)
        after(i)
        if i % every == every - 1:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(times[n // 5 :]) * 1e6


def make(name: str, probes: bool):
    from kvscope.allocator import KVPool, PoolConfig

    for p in PROBES:
        os.environ[f"KVSCOPE_{p}"] = "1" if probes else "0"
    cfg = PoolConfig(
        num_blocks=1024,
        block_size=16,
        num_layers=8,
        num_kv_heads=4,
        head_dim=64,
        dtype="float16",
        device="cuda",
        guard=probes,
        max_clients=8,
        max_seqs=256,
        quarantine=64 if probes else 0,
        events=probes,
        lockdep=probes,
    )
    return KVPool.create(name, cfg)


def operations(torch, pool, tag: str, base: int) -> dict[str, float]:
    """allocate (a 40-token prompt: 3 blocks), mark_computed (2 full blocks published), an
    append of 9 tokens (a fourth block; several tokens at once), free (4 blocks); one sequence
    per call, each its own prompt (a prompt already published would make the publication a
    no-op), numbered from `base`; then a step's publications of 4 sequences (`publications`)."""
    seqs = {}

    def allocate(i):
        first = (base + i) * 64
        seqs[i] = pool.allocate(f"{tag}{i}", list(range(first, first + 40)))

    def publish(i):
        pool.mark_computed(seqs[i], 40)

    def append(i):
        pool.append(seqs[i], list(range(9)))

    def free(i):
        pool.free(seqs.pop(i))

    steps = (("allocate", allocate), ("mark_computed", publish), ("append", append), ("free", free))
    out = {name: busy(torch, fn, n=200) for name, fn in steps}
    out.update(publications(torch, pool, tag, base))
    out.update(prefix_hit(torch, pool, tag, base))
    return out


def prefix_hit(torch, pool, tag: str, base: int) -> dict[str, float]:
    """An allocation whose prompt (40 tokens) hits the 2 blocks another request published, the
    hitting sequence freed untimed; on the probed pool with slot provenance on
    (`provenance_sample` 1, put back after), whose hit checks its blocks' digests and its
    slots' hashes, one launch."""
    prompt = list(range(20_000_000 + base, 20_000_040 + base))
    sample = pool.provenance_sample
    if pool.probe is not None:
        pool.provenance_sample = 1
    owner = pool.allocate(f"{tag}owner", prompt)
    hitters: list = []

    def hit(i):
        hitters.append(pool.allocate(f"{tag}hit{i}", prompt))

    def after(i):
        pool.free(hitters.pop())

    try:
        pool.mark_computed(owner, 40)
        return {"allocate, a 2-block hit": busy(torch, hit, n=200, after=after)}
    finally:
        pool.free(owner)
        pool.provenance_sample = sample


def publications(torch, pool, tag: str, base: int, k: int = 4) -> dict[str, float]:
    """A step's publications: k sequences of 2 full blocks each, published by k calls of
    mark_computed, or by one mark_computed_many (the sequences allocated and freed untimed)."""
    seqs: list = []

    def before(i):
        # (prompts of their own: operations' never hit them, nor they operations')
        first = 10_000_000 + (base + i) * 64 * k
        seqs[:] = [
            pool.allocate(f"{tag}m{i}.{j}", list(range(first + 64 * j, first + 64 * j + 40)))
            for j in range(k)
        ]

    def after(i):
        for s in seqs:
            pool.free(s)

    def each(i):
        for s in seqs:
            pool.mark_computed(s, 40)

    def many(i):
        pool.mark_computed_many(seqs, [40] * k)

    return {
        f"{k} x mark_computed": busy(torch, each, n=200, before=before, after=after),
        f"mark_computed_many of {k}": busy(
            torch, many, n=200, before=lambda i: before(i + 200), after=after
        ),
    }


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_pool_cuda: needs a CUDA device")
    torch.cuda.init()
    plain = make(f"bench-cuda-plain-{os.getpid()}", False)
    probed = make(f"bench-cuda-probed-{os.getpid()}", True)
    try:
        later = probed.probe.later
        assert later is not None, "a CUDA pool's checks are answered later"
        for rnd in range(2):  # the first round warms up
            a = operations(torch, plain, f"p{rnd}-", 1000 * rnd)
            b = operations(torch, probed, f"q{rnd}-", 1000 * rnd)
        print(f"{'operation':26s} {'probes off':>11s} {'kvscope run':>12s}   (host us, median)")
        for k in a:
            print(f"{k:26s} {a[k]:11.1f} {b[k]:12.1f}")
        core = probed.core

        def queue(kind: str, ids: list[int], when: str | None = None) -> None:
            """One check of the core's queue, as an operation of the core launches it."""
            with probed.op_mutex:
                core.device_queue(kind, ids, when)

        checks = [
            ("digest 1 block (publish)", lambda i: queue("stamp", [5])),
            ("digest 2 blocks (verify)", lambda i: queue("verify", [5, 6], "a check")),
            ("poison check 1 block", lambda i: queue("poison", [5])),
            ("canaries 4 blocks", lambda i: queue("canary", [5, 6, 7, 8])),
            ("never-written 3 blocks", lambda i: core.unwritten([5, 6, 7], 40, "r")),
            ("poison fill 4 blocks", lambda i: queue("fill", [5, 6, 7, 8])),
        ]
        print(f"\n{'check':28s} host us (median), launched by the C core")
        for name, fn in checks:
            print(f"{name:28s} {busy(torch, fn):8.1f}")
            later.settle(wait=True)
    finally:
        for pool in (plain, probed):
            pool.close()
            pool.unlink()


if __name__ == "__main__":
    main()
