"""What a prompt's and a request id's type cost: allocate+free pairs of a 3-token prompt given
as a list with a str id (the reference), a tuple, a numpy array, a torch tensor, a list with an
int id (the same one each pair, as a request's forks give it), and a list with a new int id each
pair, on one pool, interleaved round by round.

    python bench/bench_inputs.py [--pairs 20000] [--repeat 5] [--clock wall|cpu]

Prints pairs/s per input (median of the rounds) and each one's ratio to the list + str row, with
the spread of the per-round ratios. The C core reads every input itself (allocator/csrc/tokens.c),
so each row runs the same core call. `--clock cpu` times the process's CPU time instead of the
wall clock: on a shared, loaded machine the ratios then measure this process's own work.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import uuid
from collections.abc import Callable

import numpy as np
import torch

from kvscope.allocator import KVPool, PoolConfig

PROMPT = [11, 12, 13]


def inputs() -> dict[str, tuple[object, Callable[[int], object]]]:
    """name -> (the prompt, a request id for pair i)."""
    return {
        "list + str id": (list(PROMPT), lambda i: "r"),
        "tuple + str id": (tuple(PROMPT), lambda i: "r"),
        "numpy int64 + str id": (np.asarray(PROMPT, np.int64), lambda i: "r"),
        "torch int64 + str id": (torch.tensor(PROMPT), lambda i: "r"),
        "list + int id": (list(PROMPT), lambda i: 7),
        "list + new int id": (list(PROMPT), lambda i: i),
    }


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def rate(
    pool: KVPool, prompt: object, rid: Callable[[int], object], pairs: int, clock: str
) -> float:
    """allocate+free pairs per second."""
    alloc, free, now = pool.allocate, pool.free, CLOCKS[clock]
    t0 = now()
    for i in range(pairs):
        free(alloc(rid(i), prompt))  # type: ignore[arg-type]
    return pairs / (now() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pairs", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = ap.parse_args(argv)
    cfg = PoolConfig(num_blocks=1024, block_size=16, num_layers=1, num_kv_heads=1, head_dim=8)
    pool = KVPool.create(f"bench-inputs-{uuid.uuid4().hex[:8]}", cfg)
    cases = inputs()
    rates: dict[str, list[float]] = {k: [] for k in cases}
    gc.disable()
    try:
        for prompt, rid in cases.values():
            rate(pool, prompt, rid, args.pairs // 10, args.clock)  # warm-up
        for _ in range(args.repeat):
            for name, (prompt, rid) in cases.items():
                rates[name].append(rate(pool, prompt, rid, args.pairs, args.clock))
    finally:
        gc.enable()
        pool.close()
        pool.unlink()
    ref = rates["list + str id"]
    print(f"{'input':24} {'pairs/s':>10} {'ratio':>6}  per-round ratios")
    for name, rs in rates.items():
        ratios = [r / b for r, b in zip(rs, ref)]
        spread = " ".join(f"{x:.2f}" for x in ratios)
        print(
            f"{name:24} {statistics.median(rs):>10,.0f} {statistics.median(ratios):>5.2f}x  {spread}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
