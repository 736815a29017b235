"""A Llama-architecture decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) in plain torch.

The model never touches a KV cache itself: each layer hands its projected `q, k, v` to an
`Attend` callback, so the same weights run through the paged kernels (the engine) or through
dense causal attention over the whole sequence (the no-cache reference below).

    model = LlamaModel(ModelConfig())
    tokens = generate_reference(model, prompt=[1, 2, 3], max_new_tokens=8)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# (layer, q [tokens, heads, dim], k, v [tokens, kv_heads, dim]) -> [tokens, heads, dim]
Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]


@dataclass
class ModelConfig:
    """Geometry of a Llama decoder; defaults are the built-in tiny model."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    eos_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "heads must be a multiple of kv heads"

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face `config.json` of a Llama model."""
        num_heads = int(hf["num_attention_heads"])
        eos = hf.get("eos_token_id")
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rope_scaling=hf.get("rope_scaling"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            extra={k: hf[k] for k in ("torch_dtype", "dtype", "bos_token_id") if k in hf},
        )

    def to_hf(self) -> dict[str, Any]:
        """Write this geometry as a Hugging Face `config.json` dict for `LlamaForCausalLM`."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "eos_token_id": self.eos_token_id,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            **self.extra,
        }

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


def rope_frequencies(config: ModelConfig) -> Tensor:
    """Inverse frequencies [head_dim // 2] of the rotary embedding, with Llama 3 scaling if set."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def rotate_half(x: Tensor) -> Tensor:
    """[a, b] -> [-b, a] over the last dimension (the Hugging Face Llama convention)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def fuse_rows(linears: list[nn.Linear]) -> Tensor:
    """One weight [sum of outputs, inputs] holding `linears`' weights, which become views of
    it: one matmul instead of several, the same parameter names and memory."""
    fused = torch.cat([lin.weight.detach() for lin in linears])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused


class Attention(nn.Module):
    """Grouped-query self-attention projections; the attention itself is the `attend` callback."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        hidden, dim = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(hidden, config.num_heads * dim, bias=False)
        self.k_proj = nn.Linear(hidden, config.num_kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(hidden, config.num_kv_heads * dim, bias=False)
        self.o_proj = nn.Linear(config.num_heads * dim, hidden, bias=False)
        # set by `fuse()`: q, k and v projected in one matmul
        self.qkv: Tensor | None = None

    def fuse(self) -> None:
        self.qkv = fuse_rows([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, layer: int, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        cfg, num_tokens = self.config, x.shape[0]
        heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if self.qkv is not None:
            qkv = F.linear(x, self.qkv).view(num_tokens, heads + 2 * kv_heads, dim)
            # q and k rotated together: one set of elementwise kernels instead of two
            qk = qkv[:, : heads + kv_heads]
            qk = qk * cos + rotate_half(qk) * sin
            q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
        else:
            q = self.q_proj(x).view(num_tokens, heads, dim)
            k = self.k_proj(x).view(num_tokens, kv_heads, dim)
            v = self.v_proj(x).view(num_tokens, kv_heads, dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        out = attend(layer, q, k, v)
        return self.o_proj(out.reshape(num_tokens, heads * dim))


class MLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        # set by `fuse()`: gate and up projected in one matmul
        self.gate_up: Tensor | None = None

    def fuse(self) -> None:
        self.gate_up = fuse_rows([self.gate_proj, self.up_proj])

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up is not None:
            gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residuals."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, layer: int, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        x = x + self.self_attn(layer, self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Embedding, decoder layers and final norm (`model.*` in a Hugging Face checkpoint)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    """A Llama causal LM whose parameter names match Hugging Face's `LlamaForCausalLM`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # A plain float32 attribute, not a buffer: `model.to(bfloat16)` must not round it.
        self.inv_freq = rope_frequencies(config)

    def fuse(self) -> LlamaModel:
        """Serve with fused projections: q/k/v and gate/up each one matmul per layer (fewer,
        larger kernels). The weights become views of the fused ones: the same names, the same
        memory. Call after the weights are loaded and placed (`to()` would undo the views)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        """Hidden states [tokens, hidden] after the final norm of packed `tokens` at `positions`."""
        assert tokens.shape == positions.shape and tokens.dim() == 1
        x = self.model.embed_tokens(tokens)
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # [tokens, 1, head_dim]: broadcast over heads
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        for layer, block in enumerate(self.model.layers):
            x = block(layer, x, cos, sin, attend)
        return self.model.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: Tensor) -> Tensor:
        """Float32 next-token logits [rows, vocab] for the given hidden rows."""
        return self.lm_head(hidden).float()


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Dense causal attention of one whole sequence: q [T, H, D], k/v [T, KH, D] -> [T, H, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return out.transpose(0, 1)


def forward_reference(model: LlamaModel, tokens: list[int]) -> Tensor:
    """Logits [T, vocab] of a whole sequence, recomputed from scratch without any cache."""
    device = model.lm_head.weight.device
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    positions = torch.arange(len(tokens), device=device)
    hidden = model(ids, positions, lambda _layer, q, k, v: causal_attention(q, k, v))
    return model.logits(hidden)


def generate_reference(model: LlamaModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy generation by full recomputation at every step: the ground truth for the engine."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(int(forward_reference(model, tokens)[-1].argmax()))
    return tokens[len(prompt) :]
