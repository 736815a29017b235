"""What the store check costs (probes/stores.py): one engine step's K/V store, every layer, with
its `Writers` and the probes on, beside the same store without writers, on one pool, interleaved
round by round.

    python bench/bench_store_check.py [--seqs 64] [--prompt 512] [--layers 4] [--steps 200]
                                      [--repeat 5] [--clock wall|cpu] [--device cpu|cuda]

Two step shapes: decode (one token for each of `--seqs` requests, one `Writers` span each) and
prefill (one request's `--prompt` tokens). Prints, per shape, µs per step of the store without
writers, with them, and of the check alone (its Writers built and checked, once per step), the
medians of the rounds with their spread, and the check as a share of the store. The check itself does
not depend on the store's backend (it runs on the host), so on CPU the store is the torch
reference. `--clock cpu` counts this process's CPU time (a loaded machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

import torch

for _name in ("LEAKS", "MAGIC", "EVENTS", "OWNERSHIP", "DIGEST"):
    os.environ.setdefault(f"KVSCOPE_{_name}", "1")

from kvscope.allocator import KVPool, PoolConfig  # noqa: E402
from kvscope.kernels import store_kv  # noqa: E402
from kvscope.probes.stores import Writers, settle_writes  # noqa: E402

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def step(pool: KVPool, kv: torch.Tensor, slots: torch.Tensor, writers: Writers | None) -> None:
    """One step's store: every layer, K and V."""
    for layer in range(pool.config.num_layers):
        store_kv(kv, kv, pool.kv[layer, 0], pool.kv[layer, 1], slots, writers=writers)


def timed(pool: KVPool, spans, slots, kv, steps: int, what: str, clock: str) -> float:
    """µs per step of `what`: the store without writers, with them, or the check alone."""
    now = CLOCKS[clock]
    sync = torch.cuda.synchronize if slots.is_cuda else (lambda: None)
    sync()
    t0 = now()
    for _ in range(steps):
        if what == "check":
            Writers(pool, spans).check(slots)
        else:
            step(pool, kv, slots, Writers(pool, spans) if what == "with" else None)
    sync()
    return (now() - t0) / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--clock", choices=list(CLOCKS), default="wall")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    # (the CPU store's reference on a busy 2-core machine: one thread, less noise)
    torch.set_num_threads(1)
    config = PoolConfig(
        num_blocks=4096, block_size=16, num_layers=a.layers, num_kv_heads=2, head_dim=64,
        dtype="float16", device=a.device, max_seqs=256,
    )  # fmt: skip
    pool = KVPool.create(f"bench-store-{uuid.uuid4().hex[:8]}", config)
    try:
        assert pool.probe is not None
        dev = pool.kv.device
        decodes = [pool.allocate(f"d{i}", [i, 1000 + i, 7]) for i in range(a.seqs)]
        prompt = pool.allocate("p", list(range(5000, 5000 + a.prompt)))
        shapes = {
            "decode": (
                [(s, 2, 3) for s in decodes],
                [x for s in decodes for x in pool.slot_mapping(s, 2, 3)],
            ),
            "prefill": ([(prompt, 0, a.prompt)], pool.slot_mapping(prompt, 0, a.prompt)),
        }
        print(f"device {dev}, {a.layers} layers, {a.steps} steps x {a.repeat} rounds, {a.clock}")
        for name, (spans, slot_list) in shapes.items():
            slots = torch.tensor(slot_list, dtype=torch.int64, device=dev)
            kv = torch.randn(len(slot_list), 2, 64, device=dev).to(pool.kv.dtype)
            timed(pool, spans, slots, kv, 10, "with", a.clock)  # (warm up)
            got: dict[str, list[float]] = {"without": [], "with": [], "check": []}
            for _ in range(a.repeat):
                for what, times in got.items():
                    times.append(timed(pool, spans, slots, kv, a.steps, what, a.clock))
            settle_writes(pool, wait=True)
            assert pool.findings() == [], pool.findings()
            m = {what: statistics.median(times) for what, times in got.items()}
            share = [c / w for c, w in zip(got["check"], got["without"], strict=True)]
            print(
                f"{name:8s} {len(slot_list):5d} tokens: store {m['without']:9.1f} µs/step "
                f"(rounds {min(got['without']):.1f}..{max(got['without']):.1f}), with writers "
                f"{m['with']:9.1f}; check alone {m['check']:7.1f} µs "
                f"(rounds {min(got['check']):.1f}..{max(got['check']):.1f}) = "
                f"{statistics.median(share):.2%} of the store (rounds {min(share):.2%}.."
                f"{max(share):.2%})"
            )
        for s in [*decodes, prompt]:
            pool.free(s)
    finally:
        pool.close()
        pool.unlink()


if __name__ == "__main__":
    main()
