"""What the block-table audit costs (KVPool.audit_block_table).

    python bench/bench_audit.py [--rows 128] [--tokens 512] [--padding 0] [--calls 2000] [--repeat 5]
    python bench/bench_audit.py --step [--device cpu|cuda] [--rows 128] [--tokens 512]
                                [--model tiny|llama2-7b] [--steps 50] [--repeat 5]

Without `--step`: the audit of one `[rows + padding, width]` int32 table in host memory (each row
a live sequence of `--tokens` tokens, block size 16, width its blocks), made by the C core in one
call, on a CPU pool: µs per audit, the median of `--repeat` rounds of `--calls` calls, with the
spread, and ns per entry.

With `--step`: the example server's decode step through its step graphs (CUDA graphs on
`--device cuda`, their static buffers run eagerly on the CPU) at `--rows` running requests of
`--tokens` tokens, beside the same step through graphs that audit their whole static table as
guard mode's do (KVPool.table_audit: the comparison captured in each graph, the expected table
written by the core and uploaded each step, the answer read back at the next step), interleaved
round by round. Guard mode's kernel checks stay off in both, so the difference is the audit
alone. Prints ms per step without and with it, their medians over the rounds with the spread,
the audit's share of the step, and the host time of the graphs' forward() call per step without
and with the audit, and their difference (the audit's host time).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from kvscope.allocator import KVPool, PoolConfig  # noqa: E402

BLOCK = 16


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):9.2f} (min {min(xs):.2f}, max {max(xs):.2f})"


def host_audit(args: argparse.Namespace) -> None:
    width = -(-args.tokens // BLOCK)
    rows = args.rows + args.padding
    pool = KVPool.create(
        f"bench-audit-{uuid.uuid4().hex[:6]}",
        PoolConfig(
            num_blocks=args.rows * width + 8, block_size=BLOCK, num_layers=1, num_kv_heads=1,
            head_dim=8, dtype="float32", max_seqs=max(256, 2 * args.rows),
            max_blocks_per_seq=width + 1,
        ),
    )  # fmt: skip
    try:
        seqs = [pool.allocate(f"r{i}", list(range(i, i + args.tokens))) for i in range(args.rows)]
        table = np.full((rows, width), -1, dtype=np.int32)
        for i, s in enumerate(seqs):
            table[i, : len(s.block_table)] = s.block_table
        lengths = np.array([args.tokens] * args.rows, dtype=np.int32)
        assert pool.audit_block_table(table, rows=seqs, lengths=lengths) == []
        rounds = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                pool.audit_block_table(table, rows=seqs, lengths=lengths)
            rounds.append((time.perf_counter() - t0) / args.calls * 1e6)
        print(
            f"audit of a {rows}x{width} table ({args.rows} live rows of {args.tokens} tokens, "
            f"{args.padding} padding rows), CPU pool"
        )
        print(f"  us per audit {spread(rounds)}")
        print(f"  ns per entry {statistics.median(rounds) * 1e3 / (rows * width):9.2f}")
    finally:
        pool.close()
        pool.unlink()


def step_audit(args: argparse.Namespace) -> None:
    from server.batch import Batch
    from server.checkpoint import LLAMA2_7B, random_model, tiny_model
    from server.graphs import StepGraphs
    from server.scheduler import Chunk

    device = args.device
    torch.manual_seed(0)
    if args.model == "llama2-7b":
        model = random_model(LLAMA2_7B, device, torch.float16).fuse()
    else:
        dtype = torch.float16 if device == "cuda" else torch.float32
        model = tiny_model(0).to(device=device, dtype=dtype).fuse()
    cfg = model.config
    width = -(-args.tokens // BLOCK)
    pool = KVPool.create(
        f"bench-audit-{uuid.uuid4().hex[:6]}",
        PoolConfig(
            num_blocks=args.rows * width + 16, block_size=BLOCK, num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            dtype=str(model.lm_head.weight.dtype).removeprefix("torch."), device=device,
            max_seqs=max(256, 2 * args.rows), max_blocks_per_seq=width + 1,
        ),
    )  # fmt: skip
    try:
        # the same graphs twice: without the audit, and with it captured (guard mode's)
        plain_graphs = StepGraphs(model, pool, args.rows, width * BLOCK, max_tokens=0, audit=False)
        audit_graphs = StepGraphs(model, pool, args.rows, width * BLOCK, max_tokens=0, audit=True)

        def prompt(i: int) -> list[int]:
            return [(i * 7 + k) % cfg.vocab_size for k in range(args.tokens)]

        streams = [
            SimpleNamespace(seq=pool.allocate(f"r{i}", prompt(i)), name=i) for i in range(args.rows)
        ]
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        host_us: dict[bool, list[float]] = {False: [], True: []}

        def run(audit: bool) -> float:
            graphs = audit_graphs if audit else plain_graphs
            sync()
            spent = 0.0
            t0 = time.perf_counter()
            for _ in range(args.steps):
                chunks = [Chunk(s, s.seq.num_tokens - 1, 1) for s in streams]  # type: ignore[arg-type]
                batch = Batch(chunks, pool, device)
                a0 = time.perf_counter()
                hidden = graphs.forward(batch)
                spent += time.perf_counter() - a0
                assert hidden is not None
            sync()
            host_us[audit].append(spent / args.steps * 1e6)
            return (time.perf_counter() - t0) / args.steps * 1e3

        run(True)
        run(False)
        for v in host_us.values():
            v.clear()
        plain, audited = [], []
        for _ in range(args.repeat):
            plain.append(run(False))
            audited.append(run(True))
        assert audit_graphs.audit is not None
        found = audit_graphs.audit.settle(wait=True) + pool.findings()
        assert found == [], [f.line() for f in found]
        kind = "CUDA graphs" if device == "cuda" else "static buffers, eager"
        replays = plain_graphs.num_replays + audit_graphs.num_replays
        print(
            f"decode step of {args.rows} requests of {args.tokens} tokens, model {args.model}, "
            f"{device} ({kind}; {replays} replays)"
        )
        print(f"  ms per step, no audit   {spread(plain)}")
        print(f"  ms per step, audited    {spread(audited)}")
        share = (statistics.median(audited) - statistics.median(plain)) / statistics.median(plain)
        print(f"  the audit's share of the step {share * 100:+.2f}%")
        print(f"  host us per step in forward(), no audit {spread(host_us[False])}")
        print(f"  host us per step in forward(), audited  {spread(host_us[True])}")
        pairs = [w - o for w, o in zip(host_us[True], host_us[False], strict=True)]
        print(f"  the audit's host time, us per step {spread(pairs)}")
    finally:
        pool.close()
        pool.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--padding", type=int, default=0)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--step", action="store_true")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--model", choices=["tiny", "llama2-7b"], default="tiny")
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_audit: --device cuda: no CUDA device here")
    torch.set_num_threads(1)
    (step_audit if args.step else host_audit)(args)


if __name__ == "__main__":
    main()
