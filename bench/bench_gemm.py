"""The matrix-multiply ceiling of a prompt step: Llama-2-7B's layer GEMMs alone, as cuBLAS runs them.

    python bench/bench_gemm.py --device cuda            # tokens per step 2048, 4096, 8192

A prompt-heavy step (a long prompt's prefill, a scoring request) is nearly all matrix work: the
fused QKV projection, the output projection, the fused gate/up projection and the down
projection of each layer, over the step's tokens. This measures those four GEMMs with torch's
`linear` (cuBLAS) at a step's token count, fp16, nothing else on the GPU: the TFLOP/s no engine
built on them exceeds end to end, the figure docs/BENCHMARKS.md sets beside the prefix-sharing
table's prompt-bound cases. Each shape is warmed up, then timed over `--iters` calls between two
synchronizations; `--repeat` rounds, the median and range printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

HIDDEN, INTERMEDIATE = 4096, 11008  # Llama-2-7B
# (in features, out features) of a layer's GEMMs: QKV fused, O, gate+up fused, down
LAYER = ((HIDDEN, 3 * HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTERMEDIATE), (INTERMEDIATE, HIDDEN))


def layer_tflops(tokens: int, device: str, iters: int) -> float:
    """The four GEMMs of a layer over `tokens` rows: their FLOPs over their summed time."""
    seconds, flops = 0.0, 0
    for k, n in LAYER:
        a = torch.randn(tokens, k, device=device, dtype=torch.float16)
        w = torch.randn(n, k, device=device, dtype=torch.float16)
        for _ in range(5):
            torch.nn.functional.linear(a, w)
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(iters):
            torch.nn.functional.linear(a, w)
        torch.cuda.synchronize()
        seconds += (time.perf_counter() - began) / iters
        flops += 2 * tokens * k * n
    return flops / seconds / 1e12


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda", help="a CUDA device (default cuda)")
    ap.add_argument("--tokens", default="2048,4096,8192", help="tokens per step, comma-separated")
    ap.add_argument("--iters", type=int, default=50, help="calls timed per shape (default 50)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not args.device.startswith("cuda"):
        ap.error("needs a CUDA device")
    try:
        counts = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        ap.error(f"--tokens: comma-separated integers, not {args.tokens!r}")
    print(f"{torch.cuda.get_device_name(args.device)}; Llama-2-7B layer GEMMs, fp16, TFLOP/s")
    for tokens in counts:
        rounds = [layer_tflops(tokens, args.device, args.iters) for _ in range(args.repeat)]
        print(
            f"tokens {tokens:>6}: {statistics.median(rounds):.0f} "
            f"({min(rounds):.0f}-{max(rounds):.0f}, {args.repeat} rounds)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
