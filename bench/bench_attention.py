"""Decode attention on the GPU, side by side: SDPA on a contiguous cache (the dense ideal),
gather-then-SDPA (the naive paged way) and kvscope's paged decode kernel (plain, guard mode,
fp8 cache). bf16, 32 query heads / 8 KV heads, head_dim 128, block 16.

Every time is the median of CUDA-graph replays with L2 flushed before each one
(`triton.testing.do_bench`); the roofline is a device-to-device copy timed the same way in the
same run. Usage::

    python bench/bench_attention.py                 # the table
    python bench/bench_attention.py --sweep         # also search launch configs per shape
    python bench/bench_attention.py --old DIR       # also the kernels package saved in DIR
                                                    # (e.g. an older kernels/), side by side
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parents[1]
try:
    import kvscope.kernels  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))
    import kvscope

    kvscope.__path__.append(str(ROOT))

from kvscope.kernels import new_error_buffer  # noqa: E402
from kvscope.kernels.common import check_attention_inputs  # noqa: E402
from kvscope.kernels.decode import DecodeConfig, launch_decode  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16


@dataclass
class Shape:
    """A decode batch: its name and each sequence's context length."""

    name: str
    lens: list[int]


def shapes(seed: int) -> list[Shape]:
    gen = torch.Generator().manual_seed(seed)
    ragged = torch.randint(128, 8193, (64,), generator=gen).tolist()
    return [
        Shape("1x32768", [32768]),
        Shape("16x4096", [4096] * 16),
        Shape("64x4096", [4096] * 64),
        Shape("128x2048", [2048] * 128),
        Shape("ragged64xU[128,8192]", ragged),
    ]


class Problem:
    """A paged pool with shuffled blocks holding `lens` tokens, and its contiguous twin."""

    def __init__(self, shape: Shape, fp8: bool = False):
        dev = "cuda"
        self.lens = shape.lens
        need = [math.ceil(n / BLOCK) for n in shape.lens]
        num_blocks = sum(need)
        perm = torch.randperm(num_blocks, device=dev).to(torch.int32)
        self.tables = torch.full((len(need), max(need)), -1, dtype=torch.int32, device=dev)
        used = 0
        for i, n in enumerate(need):
            self.tables[i, :n] = perm[used : used + n]
            used += n
        self.seq_lens = torch.tensor(shape.lens, dtype=torch.int32, device=dev)
        cache = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        self.k = torch.randn(cache, device=dev, dtype=DTYPE)
        self.v = torch.randn(cache, device=dev, dtype=DTYPE)
        self.q = torch.randn(len(need), Q_HEADS, HEAD_DIM, device=dev, dtype=DTYPE)
        self.state = torch.ones(num_blocks, dtype=torch.uint8, device=dev)
        self.errors = new_error_buffer(device=dev)
        self.kv_bytes = sum(shape.lens) * KV_HEADS * HEAD_DIM * 2 * self.k.element_size()

    def dense(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """K, V as [batch, kv_heads, max_len, dim] contiguous, and a padding mask if ragged."""
        width = self.tables.shape[1] * BLOCK
        idx = self.tables.long().clamp_min(0)
        k = self.k[idx].reshape(len(self.lens), width, KV_HEADS, HEAD_DIM)
        v = self.v[idx].reshape(len(self.lens), width, KV_HEADS, HEAD_DIM)
        k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        mask = None
        if len(set(self.lens)) > 1 or width != self.lens[0]:
            pos = torch.arange(width, device="cuda")
            mask = (pos[None, :] < self.seq_lens[:, None])[:, None, None, :]
        return k, v, mask


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, enable_gqa=True)


def gather_sdpa(p: Problem, mask) -> torch.Tensor:
    idx = p.tables.long().clamp_min(0)
    b, width = len(p.lens), p.tables.shape[1] * BLOCK
    k = p.k[idx].reshape(b, width, KV_HEADS, HEAD_DIM).transpose(1, 2)
    v = p.v[idx].reshape(b, width, KV_HEADS, HEAD_DIM).transpose(1, 2)
    return sdpa(p.q, k, v, mask)


def capture(fn) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `fn` (warmed up on a side stream first)."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def graph_us(fn, rep: int = 300) -> float:
    """Median µs of CUDA-graph replays of `fn`, L2 flushed before each (do_bench)."""
    return 1000 * do_bench(capture(fn).replay, warmup=50, rep=rep, return_mode="median")


def copy_roofline_gbs() -> float:
    """Device-to-device copy bandwidth, bytes read + written per second, 1 GiB each way.

    Timed without a graph: a captured copy_ becomes a memcpy node that may run on a copy
    engine, slower than the copy kernel an eager copy_ launches (and 1 GiB hides launch cost).
    """
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    us = 1000 * do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * (1 << 30) / us / 1e3


def read_roofline_gbs() -> float:
    """Read-only bandwidth: a bf16 sum over 1 GiB (bytes read per second)."""
    src = torch.randn(1 << 29, dtype=DTYPE, device="cuda")
    out = torch.empty((), dtype=torch.float32, device="cuda")
    us = graph_us(lambda: torch.sum(src, dim=0, dtype=torch.float32, out=out))
    return (1 << 30) / us / 1e3


def ours(
    p: Problem, cfg: DecodeConfig | None = None, guard: bool = False, fp8=None, hints=True,
    pkg=None,
):  # fmt: skip
    """A closure launching the decode kernel on `p` (hints: pass the batch's max/total length;
    pkg: another kernels package, e.g. the one saved by `--old`)."""
    k, v = (p.k, p.v) if fp8 is None else fp8[:2]
    scales = {} if fp8 is None else {"k_scale": fp8[2], "v_scale": fp8[3]}
    extra = {"block_state": p.state, "errors": p.errors} if guard else {}
    a = check_attention_inputs(
        p.q, k, v, p.tables, p.seq_lens, None, None,
        scales.get("k_scale"), scales.get("v_scale"), extra.get("block_state"), extra.get("errors"),
    )  # fmt: skip
    out = torch.empty_like(p.q)
    kw = {"max_seq_len": max(p.lens), "total_seq_len": sum(p.lens)} if hints else {}
    if pkg is not None:
        a = pkg.common.check_attention_inputs(
            p.q, k, v, p.tables, p.seq_lens, None, None, scales.get("k_scale"),
            scales.get("v_scale"), extra.get("block_state"), extra.get("errors"),
        )  # fmt: skip

        takes_hints = "max_seq_len" in inspect.signature(pkg.decode.launch_decode).parameters
        old_kw = kw if takes_hints else {}

        def run_old() -> torch.Tensor:
            pkg.decode.launch_decode(a, out, **old_kw)
            return out

        return run_old

    def run() -> torch.Tensor:
        launch_decode(a, out, cfg, **kw)
        return out

    return run


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


SWEEP = [
    {"num_stages": 3},
    {"fused_merge": True},
    {"kvh_fast": False},
    {"max_regs": 128},
    {"ctas_per_sm": 2},
    {"chunk_blocks": 32},
    {"chunk_blocks": 64},
    {"merge_heads": 0, "merge_split_tile": 16},
    {"stream_max_tiles": 0},
    {"stream_max_tiles": 16},
    {"merge_warps": 4},
    {"merge_pdl": False},
]
SWEEP_GUARD = [{"guard_max_regs": 128}, {"guard_pdl": False}]
SWEEP_FP8 = [{"fp8_tile": 64}, {"fp8_f16": False}]


def sweep(p: Problem, fp8) -> dict[str, float]:
    """Time the default config and one change at a time from it: plain, guard and fp8."""
    results = {}
    runs = [("plain", {}, {})] + [("plain", c, {}) for c in SWEEP]
    runs += [("guard", c, {"guard": True}) for c in SWEEP_GUARD]
    runs += [("fp8", c, {"fp8": fp8}) for c in SWEEP_FP8]
    for kind, change, kw in runs:
        name = kind + " " + (",".join(f"{k}={v}" for k, v in change.items()) or "default")
        try:
            results[name] = graph_us(ours(p, DecodeConfig(**change), **kw), rep=150)
        except Exception as exc:  # e.g. out of shared memory for a large tile
            print(f"  skip {name}: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)
    return results


def measure(shape: Shape, peak_gbs: float, do_sweep: bool, old=None) -> tuple[dict, dict]:
    """Every variant's median µs on one shape, plus the best sweep configs when asked."""
    p = Problem(shape)
    k, v, mask = p.dense()
    want = sdpa(p.q, k, v, mask)[:, :, 0]
    t = {"sdpa_contiguous": graph_us(lambda: sdpa(p.q, k, v, mask))}
    k = v = None
    t["gather_sdpa"] = graph_us(lambda: gather_sdpa(p, mask))
    run = ours(p)
    err = rel(run(), want)
    t["kvscope"] = graph_us(run)
    guarded = ours(p, guard=True)
    t["kvscope_guard"] = float("nan")
    try:
        guarded()
        assert int(p.errors[0]) == 0, "guard mode flagged a clean pool"
        t["kvscope_guard"] = graph_us(guarded)
    except Exception as exc:
        print(f"  guard failed: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)
    t["kvscope_again"] = graph_us(run)
    t["kvscope_nohint"] = graph_us(ours(p, hints=False))
    k_scale = torch.tensor([p.k.float().abs().amax() / 448], device="cuda")
    v_scale = torch.tensor([p.v.float().abs().amax() / 448], device="cuda")
    k8 = (p.k.float() / k_scale).to(torch.float8_e4m3fn)
    v8 = (p.v.float() / v_scale).to(torch.float8_e4m3fn)
    fp8 = ours(p, fp8=(k8, v8, k_scale, v_scale))
    err8 = rel(fp8(), want)
    t["kvscope_fp8"] = graph_us(fp8)
    if old is not None:
        run_old = ours(p, pkg=old)
        err_old = rel(run_old(), want)
        assert err_old < 1e-2, err_old
        t["old"] = graph_us(run_old)
        p.errors.zero_()
        p.errors[1] = (p.errors.numel() - 2) // 5
        t["old_guard"] = graph_us(ours(p, guard=True, pkg=old))
        t["old_fp8"] = graph_us(ours(p, fp8=(k8, v8, k_scale, v_scale), pkg=old))
    best = sweep(p, (k8, v8, k_scale, v_scale)) if do_sweep else {}
    floor = p.kv_bytes / peak_gbs / 1e3
    row = {"shape": shape.name, "kv_bytes": p.kv_bytes, "floor_us": floor,
           "rel_err": err, "rel_err_fp8": err8, **t}  # fmt: skip
    return row, best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="search launch configs per shape")
    ap.add_argument("--json", type=Path, help="write every number here too")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--old", type=Path, help="a saved kernels package dir to time side by side")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}")  # fmt: skip
    copy_gbs, read_gbs = copy_roofline_gbs(), read_roofline_gbs()
    print(f"# roofline: d2d copy {copy_gbs:.0f} GB/s (read+write), bf16 sum {read_gbs:.0f} GB/s")
    old = None
    if args.old:
        sys.path.insert(0, str(args.old.resolve().parent))
        name = args.old.resolve().name
        old = importlib.import_module(name)
        old.common = importlib.import_module(name + ".common")
        old.decode = importlib.import_module(name + ".decode")
    print(f"# kvscope default {asdict(DecodeConfig())}")
    rows, sweeps = [], {}
    for shape in shapes(args.seed):
        row, best = measure(shape, max(copy_gbs, read_gbs), args.sweep, old)
        rows.append(row)
        if args.sweep:
            sweeps[shape.name] = best
        torch.cuda.empty_cache()
    if sweeps:
        names = list(next(iter(sweeps.values())))
        print("| variant | " + " | ".join(sweeps) + " |")
        print("|" + "---|" * (len(sweeps) + 1))
        for n in names:
            cells = [f"{sweeps[sh].get(n, float('nan')):.1f}" for sh in sweeps]
            print(f"| {n} | " + " | ".join(cells) + " |")
    head = ["shape", "floor", "SDPA contig", "gather+SDPA", "old", "kvscope", "GB/s", "% copy",
            "% read", "again", "no hint", "guard", "guard ovh", "fp8", "old guard", "old fp8",
            "err", "err fp8"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        gbs = r["kv_bytes"] / r["kvscope"] / 1e3
        cells = [
            r["shape"], f"{r['floor_us']:.0f}", f"{r['sdpa_contiguous']:.1f}",
            f"{r['gather_sdpa']:.1f}", f"{r.get('old', float('nan')):.1f}",
            f"{r['kvscope']:.1f}", f"{gbs:.0f}",
            f"{100 * gbs / copy_gbs:.0f}%", f"{100 * gbs / read_gbs:.0f}%", f"{r['kvscope_again']:.1f}",
            f"{r['kvscope_nohint']:.1f}", f"{r['kvscope_guard']:.1f}", f"{100 * (r['kvscope_guard'] / r['kvscope'] - 1):+.1f}%",
            f"{r['kvscope_fp8']:.1f}", f"{r.get('old_guard', float('nan')):.1f}",
            f"{r.get('old_fp8', float('nan')):.1f}", f"{r['rel_err']:.1e}",
            f"{r['rel_err_fp8']:.1e}",
        ]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"copy_gbs": copy_gbs, "read_gbs": read_gbs,
                                         "rows": rows, "sweeps": sweeps}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
