"""Decode-kernel experiments on the GPU: launch configs side by side, two kinds of L2 flush,
and time against context length (bandwidth and fixed cost by least squares).

    python bench/decode_lab.py configs '{"base": {}, "no-stream": {"stream_max_tiles": 0}}'
    python bench/decode_lab.py lengths            # batch 16 and 64, lengths 512-16384
    python bench/decode_lab.py floor              # the same bytes, only read, same harness

`configs` times SDPA on a contiguous cache and kvscope's decode with each `DecodeConfig`
override on bench_attention's five shapes. Every time is the median of 200 CUDA-graph replays,
each after an L2 flush; "dirty" flushes by writing 256 MB (what `triton.testing.do_bench`
does: L2 is left full of dirty lines that the timed kernel must write back), "clean" by
reading it (the lines it leaves need no write-back). The difference is the write-back cost.
`floor` times, in the same harness, kernels that do nothing but read each shape's K+V bytes
once from a contiguous buffer: `torch.sum`, and the fastest of a plain Triton streaming read
over a few grid sizes and pipeline depths, with and without an L2 evict-first hint. A decode
kernel must read at least those bytes, so the fastest of them is what it cannot beat.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_attention as ba  # noqa: E402

from kvscope.kernels.decode import DecodeConfig  # noqa: E402

FLUSH = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
SINK = torch.empty((), dtype=torch.float32, device="cuda")


def flush_dirty() -> None:
    FLUSH.zero_()


def flush_clean() -> None:
    torch.sum(FLUSH, dim=0, dtype=torch.float32, out=SINK)


def timed_us(graph: torch.cuda.CUDAGraph, flush: Callable[[], None], reps: int = 200) -> float:
    """Median µs of graph replays, each after `flush`."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(20):
        flush()
        graph.replay()
    for s, e in zip(starts, ends):
        flush()
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    return 1000 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def sdpa_graph(p: ba.Problem) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A graph of SDPA on p's contiguous twin, and its output (the reference)."""
    k, v, mask = p.dense()
    return ba.capture(lambda: ba.sdpa(p.q, k, v, mask)), ba.sdpa(p.q, k, v, mask)[:, :, 0]


def run_configs(configs: dict[str, dict]) -> None:
    for shape in ba.shapes(0):
        p = ba.Problem(shape)
        g, want = sdpa_graph(p)
        cells = [f"sdpa {timed_us(g, flush_dirty):.1f}/{timed_us(g, flush_clean):.1f}"]
        del g
        for name, change in configs.items():
            run = ba.ours(p, DecodeConfig(**change))
            err = ba.rel(run(), want)
            g = ba.capture(run)
            cells.append(f"{name} {timed_us(g, flush_dirty):.1f}/{timed_us(g, flush_clean):.1f}")
            if err > 1e-2:
                cells[-1] += f" (err {err:.1e})"
            del g
        print(f"{shape.name}: " + "  ".join(cells) + "   (µs, dirty/clean flush)", flush=True)
        del p
        torch.cuda.empty_cache()


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def run_lengths() -> None:
    tiny = torch.zeros(16, device="cuda")
    g = ba.capture(lambda: tiny.add_(1))
    print(f"one-element kernel: {timed_us(g, flush_dirty):.1f} µs (the harness floor)")
    for batch, lens in ((16, [512, 1024, 2048, 4096, 8192, 16384]), (64, [1024, 2048, 4096])):
        gb, t_sdpa, t_ours = [], [], []
        for n in lens:
            p = ba.Problem(ba.Shape(f"{batch}x{n}", [n] * batch))
            g, _ = sdpa_graph(p)
            t_sdpa.append(timed_us(g, flush_dirty))
            del g
            g = ba.capture(ba.ours(p))
            t_ours.append(timed_us(g, flush_dirty))
            gb.append(p.kv_bytes / 1e9)
            print(f"{batch}x{n}: sdpa {t_sdpa[-1]:.1f} kvscope {t_ours[-1]:.1f} µs", flush=True)
            del g, p
            torch.cuda.empty_cache()
        for name, ts in (("sdpa", t_sdpa), ("kvscope", t_ours)):
            slope, icpt = fit(gb, ts)
            print(f"batch {batch} {name}: {1e3 / slope:.2f} TB/s, fixed {icpt:.1f} µs")


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, per_prog, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    """Read x[pid * per_prog, +per_prog) once (16-byte loads); store its sum."""
    start = tl.program_id(0).to(tl.int64) * per_prog
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, per_prog, BLOCK):
        offs = start + i + tl.arange(0, BLOCK)
        if EVICT:
            x = tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first")
        else:
            x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        acc += x.to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def read_floor(n: int) -> str:
    """Dirty/clean µs of only reading n bf16 elements once: torch.sum, and the fastest plain
    Triton streaming read (programs per SM x pipeline stages x elements per step x warps;
    the dirty time decides), without and with an evict-first hint."""
    buf = torch.randn(n, device="cuda").to(torch.bfloat16)
    sink = torch.empty((), dtype=torch.float32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    parts = torch.empty(32 * sms, dtype=torch.float32, device="cuda")

    def read(progs: int, stages: int, evict: bool, block: int, warps: int) -> Callable[[], None]:
        per = triton.cdiv(triton.cdiv(n, progs), block) * block
        kernel = _read_kernel[(progs,)]
        return lambda: kernel(buf, parts, n, per, BLOCK=block, EVICT=evict, num_warps=warps,
                              num_stages=stages)  # fmt: skip

    runs = {"sum": lambda: torch.sum(buf, dim=0, dtype=torch.float32, out=sink)}
    for per_sm in (4, 8, 16, 32):
        for stages, evict in ((1, False), (2, False), (4, False), (1, True)):
            for block, warps in ((4096, 8), (8192, 8), (2048, 4)):
                name = f"read {per_sm}/SM {stages} stages {block}x{warps}w"
                runs[name + (" evict-first" if evict else "")] = read(
                    per_sm * sms, stages, evict, block, warps
                )
    cells = {}
    for name, fn in runs.items():
        g = ba.capture(fn)
        cells[name] = (timed_us(g, flush_dirty), timed_us(g, flush_clean))
        del g
    plain = min((k for k in cells if "read" in k and "evict" not in k), key=lambda k: cells[k][0])
    evict = min((k for k in cells if "evict" in k), key=lambda k: cells[k][0])
    return "  ".join(f"{k} {cells[k][0]:.1f}/{cells[k][1]:.1f}" for k in ("sum", plain, evict))


def run_floor() -> None:
    tiny = torch.zeros(16, device="cuda")
    g = ba.capture(lambda: tiny.add_(1))
    print(f"one-element kernel: {timed_us(g, flush_dirty):.1f}/{timed_us(g, flush_clean):.1f} µs")
    del g
    for shape in ba.shapes(0):
        n = sum(shape.lens) * ba.KV_HEADS * ba.HEAD_DIM * 2  # bf16 K+V elements
        print(f"{shape.name} ({n * 2 / 1e6:.0f} MB): {read_floor(n)}   (µs, dirty/clean)")
        torch.cuda.empty_cache()


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "configs":
        run_configs(json.loads(argv[1]))
    elif argv == ["lengths"]:
        run_lengths()
    elif argv == ["floor"]:
        run_floor()
    else:
        print("usage: decode_lab.py configs JSON | lengths | floor", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
