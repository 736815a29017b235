"""Hugging Face-format checkpoints (config.json + safetensors) and the built-in tiny model.

Reads with the `safetensors` package when it is installed, otherwise with the small reader
below: a safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw little-endian bytes.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import struct
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .errors import ServeError
from .model import LlamaModel, ModelConfig, rope_frequencies

DTYPE_TO_TORCH = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
TORCH_TO_DTYPE = {v: k for k, v in DTYPE_TO_TORCH.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024
LARGE_MODEL_PARAMS = 50_000_000


def read_safetensors(path: Path) -> dict[str, Tensor]:
    """All tensors of one safetensors file, on the CPU."""
    try:
        from safetensors.torch import load_file
    except ImportError:
        return read_safetensors_pure(path)
    try:
        return load_file(str(path))
    except Exception as exc:
        raise ServeError(f"{path}: not a readable safetensors file ({exc})") from exc


def read_safetensors_pure(path: Path) -> dict[str, Tensor]:
    """All tensors of one safetensors file, read without the `safetensors` package."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        if size < 8:
            raise ServeError(f"{path}: not a safetensors file (only {size} bytes)")
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise ServeError(f"{path}: not a safetensors file (header length {header_len})")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ServeError(f"{path}: not a safetensors file (bad JSON header)") from exc
        # A private copy-on-write mapping: pages load lazily and torch gets a writable buffer.
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 0 else b""
    start = 8 + header_len
    tensors: dict[str, Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPE_TO_TORCH.get(info.get("dtype"))
        if dtype is None:
            raise ServeError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')}")
        begin, end = info["data_offsets"]
        shape = list(info["shape"])
        numel = 1
        for dim in shape:
            numel *= dim
        itemsize = torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end <= size - start or end - begin != numel * itemsize:
            raise ServeError(f"{path}: tensor {name!r} has a bad byte range [{begin}, {end})")
        if numel == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(data, dtype=dtype, count=numel, offset=start + begin)
        tensors[name] = flat.view(shape).clone()
    return tensors


def write_safetensors(tensors: dict[str, Tensor], path: Path) -> None:
    """Write tensors as one safetensors file (readable by the `safetensors` package too)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu").contiguous()
        blob = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {
            "dtype": TORCH_TO_DTYPE[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header, separators=(",", ":")).encode()
    # Pad the header with spaces so the data starts 8-byte aligned, as the reference writer does.
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


def tiny_model(seed: int = 0, config: ModelConfig | None = None) -> LlamaModel:
    """The built-in random-weight model: seeded, created in memory, no download."""
    config = config or ModelConfig()
    generator = torch.Generator().manual_seed(seed)
    model = LlamaModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith("embed_tokens.weight"):
                param.copy_(torch.randn(param.shape, generator=generator))
            else:
                # 1/sqrt(fan_in): logits spread O(1), so greedy choices are far from ties.
                std = param.shape[1] ** -0.5
                param.copy_(std * torch.randn(param.shape, generator=generator))
    return model.eval()


# The geometry of Llama-2-7B (the prefix-sharing report's model), for random-weight benchmarks.
LLAMA2_7B = ModelConfig(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    rms_norm_eps=1e-5,
)


def random_model(config: ModelConfig, device: str, dtype: torch.dtype, seed: int = 0) -> LlamaModel:
    """A model of `config`'s shape with random weights made on `device` in `dtype`.

    For geometries too large to write and load as a checkpoint just to time them (a 7B model is
    13 GB of fp16): nothing is downloaded or stored; the weights are torch's default init.
    """
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaModel(config)
    finally:
        torch.set_default_dtype(previous)
    model.inv_freq = rope_frequencies(config)
    return model.eval()


def save_model(model: LlamaModel, directory: Path) -> None:
    """Write `config.json` and `model.safetensors` in the Hugging Face layout."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2))
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    write_safetensors(state, directory / "model.safetensors")


def load_config(directory: Path) -> ModelConfig:
    """The model geometry from a Hugging Face directory's `config.json`, without the weights."""
    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        raise ServeError(f"--model {directory}: no config.json there (expected a Hugging Face dir)")
    try:
        hf = json.loads(config_path.read_text())
        config = ModelConfig.from_hf(hf)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AssertionError) as exc:
        raise ServeError(f"{config_path}: not a Llama config ({exc!r})") from exc
    architectures = hf.get("architectures") or ["LlamaForCausalLM"]
    if hf.get("model_type", "llama") != "llama" and "LlamaForCausalLM" not in architectures:
        raise ServeError(f"{config_path}: model_type {hf.get('model_type')!r} is not llama")
    return config


def load_model(
    directory: Path, dtype: torch.dtype | None = None, device: str = "cpu"
) -> LlamaModel:
    """A `LlamaModel` from a local Hugging Face-format directory; `dtype=None` keeps the file's."""
    directory = Path(directory)
    config = load_config(directory)
    config_path = directory / "config.json"
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ServeError(f"--model {directory}: no *.safetensors files there")
    state: dict[str, Tensor] = {}
    for file in files:
        state.update(read_safetensors(file))
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    try:
        # A large model gets meta parameters: no memory and no random init for weights about to
        # be replaced. (Building on meta imports torch._dynamo, a second: not worth it when small.)
        num_params = sum(t.numel() for t in state.values())
        large = num_params > LARGE_MODEL_PARAMS
        with torch.device("meta") if large else contextlib.nullcontext():
            model = LlamaModel(config)
        inv_freq = rope_frequencies(config)
    except ValueError as exc:
        raise ServeError(f"{config_path}: {exc}") from exc
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = set(model.state_dict()) - (
        {"lm_head.weight"} if config.tie_word_embeddings else set()
    )
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ServeError(
            f"--model {directory}: weights do not match the config "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    wanted = dtype or state["model.embed_tokens.weight"].dtype
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:
        raise ServeError(f"--model {directory}: weight shapes do not match the config") from exc
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = inv_freq
    return model.to(device=device, dtype=wanted).eval()
