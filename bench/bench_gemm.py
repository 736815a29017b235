"""The matrix-multiply ceiling of a prompt step: Llama-2-7B's layer GEMMs alone, as cuBLAS runs them.

    python bench/bench_gemm.py --device cuda            # tokens per step 2048, 4096, 8192

A prompt-heavy step (a long prompt's prefill, a scoring request) is nearly all matrix work: the
fused QKV projection, the output projection, the fused gate/up projection and the down
projection of each layer, over the step's tokens. This measures, at a step's token count, fp16:
- those four GEMMs with torch's `linear` (cuBLAS), nothing else on the GPU: the TFLOP/s no engine
  built on them exceeds end to end;
- one decoder layer of the example engine (examples/server/model.py, fused projections) with its
  attention left out (its `attend` returns an empty tensor of q's shape), as it runs: the GEMMs
  and the RMSNorms, rotary embedding, SiLU and residual adds between them, each a torch kernel;
- the same layer with those elementwise steps compiled (`torch.compile`, one fused kernel each:
  the norm with the residual add before it, the rotation, SiLU times up);
- the layer's GEMMs alone, in its order.
The layer's figures are ms per layer; a step is 32 of them plus its attention. docs/BENCHMARKS.md
sets them beside the prefix-sharing table's prompt-bound cases. Each is warmed up, then timed
over `--iters` calls between two synchronizations; `--repeat` rounds, the median and range.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from server.checkpoint import LLAMA2_7B  # noqa: E402
from server.model import DecoderLayer, rotate_half  # noqa: E402

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


def timed_ms(fn: Callable[[], object], iters: int) -> float:
    """ms per call of `fn`, after a warm-up, between two synchronizations."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / iters * 1e3


@torch.compile(dynamic=True)
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@torch.compile(dynamic=True)
def _add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    s32 = s.float()
    return s, weight * (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@torch.compile(dynamic=True)
def _rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return qk * cos + rotate_half(qk) * sin


@torch.compile(dynamic=True)
def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def layer_ms(tokens: int, device: str, iters: int) -> tuple[float, float, float]:
    """ms per decoder layer over `tokens`: as the engine runs it, its elementwise steps
    compiled, its GEMMs alone (attention left out of all three)."""
    cfg = LLAMA2_7B
    heads, kv_heads, dim, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    layer = DecoderLayer(cfg).to(device, torch.float16)
    layer.self_attn.fuse()
    layer.mlp.fuse()
    attn, mlp = layer.self_attn, layer.mlp
    assert attn.qkv is not None and mlp.gate_up is not None
    x = torch.randn(tokens, cfg.hidden_size, device=device, dtype=torch.float16)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device).float() / dim))
    freqs = torch.arange(tokens, device=device).float()[:, None] * inv[None]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().half()[:, None], emb.sin().half()[:, None]

    def no_attention(_layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        return torch.empty_like(q)

    def compiled() -> torch.Tensor:
        h = _rms_norm(x, layer.input_layernorm.weight, eps)
        qkv = F.linear(h, attn.qkv).view(tokens, heads + 2 * kv_heads, dim)
        qk = _rope(qkv[:, : heads + kv_heads], cos, sin)
        out = no_attention(0, qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :])
        s, h = _add_rms_norm(
            x,
            attn.o_proj(out.reshape(tokens, heads * dim)),
            layer.post_attention_layernorm.weight,
            eps,
        )
        return s + mlp.down_proj(_silu_mul(F.linear(h, mlp.gate_up)))

    def gemms() -> torch.Tensor:
        qkv = F.linear(x, attn.qkv)
        attn.o_proj(qkv[:, : heads * dim])
        return mlp.down_proj(F.linear(x, mlp.gate_up)[:, : cfg.intermediate_size])

    with torch.inference_mode():
        eager = timed_ms(lambda: layer(0, x, cos, sin, no_attention), iters)
        fused = timed_ms(compiled, iters)
        alone = timed_ms(gemms, iters)
    return eager, fused, alone


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
    print(
        "one decoder layer without its attention, ms: as the engine runs it / elementwise "
        "compiled / GEMMs alone"
    )
    for tokens in counts:
        rounds = [layer_ms(tokens, args.device, args.iters) for _ in range(args.repeat)]
        cols = []
        for i in range(3):
            vals = [r[i] for r in rounds]
            cols.append(f"{statistics.median(vals):.3f} ({min(vals):.3f}-{max(vals):.3f})")
        eager = statistics.median(r[0] for r in rounds)
        alone = statistics.median(r[2] for r in rounds)
        print(f"tokens {tokens:>6}: {' / '.join(cols)}; as run / GEMMs alone {eager / alone:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
