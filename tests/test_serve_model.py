"""serve.py's model and checkpoints: safetensors I/O, Hugging Face layout, the no-cache reference."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from server import checkpoint  # noqa: E402
from server.checkpoint import (  # noqa: E402
    load_model,
    read_safetensors_pure,
    save_model,
    tiny_model,
    write_safetensors,
)
from server.errors import ServeError  # noqa: E402
from server.model import (  # noqa: E402
    LlamaModel,
    ModelConfig,
    causal_attention,
    forward_reference,
    generate_reference,
    rope_frequencies,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_safetensors_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    # GIVEN tensors of odd shapes, one of them empty
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": (torch.randn(3, 5, generator=g) * 100).to(dtype),
        "b": (torch.randn(7, generator=g) * 100).to(dtype),
        "empty": torch.zeros(0, 4, dtype=dtype),
    }
    # WHEN written by our writer and read by the pure-python reader
    write_safetensors(tensors, tmp_path / "t.safetensors")
    back = read_safetensors_pure(tmp_path / "t.safetensors")
    # THEN every tensor comes back bit for bit, and the data starts 8-byte aligned
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == dtype and torch.equal(back[name], tensor)
    raw = (tmp_path / "t.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    assert header_len % 8 == 0
    assert json.loads(raw[8 : 8 + header_len])["__metadata__"] == {"format": "pt"}


def test_safetensors_reader_agrees_with_the_package(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    tensors = {"x": torch.arange(12, dtype=torch.float32).view(3, 4), "y": torch.ones(2).half()}
    safetensors_torch.save_file(tensors, str(tmp_path / "p.safetensors"))
    back = read_safetensors_pure(tmp_path / "p.safetensors")
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


@pytest.mark.parametrize(
    "blob",
    [b"", b"\x01\x00", struct.pack("<Q", 10**9) + b"{}", struct.pack("<Q", 4) + b"nope"],
    ids=["empty", "short", "huge-header", "bad-json"],
)
def test_a_broken_safetensors_file_is_a_user_error(tmp_path: Path, blob: bytes) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(ServeError, match="not a safetensors file"):
        read_safetensors_pure(path)


def test_a_tensor_past_the_end_of_the_file_is_a_user_error(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    path = tmp_path / "cut.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00" * 8)
    with pytest.raises(ServeError, match="bad byte range"):
        read_safetensors_pure(path)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_saved_checkpoint_loads_back_to_the_same_model(tmp_path: Path, tied: bool) -> None:
    # GIVEN a random model saved in the Hugging Face layout
    model = tiny_model(3, ModelConfig(tie_word_embeddings=tied))
    save_model(model, tmp_path)
    assert (tmp_path / "config.json").is_file() and (tmp_path / "model.safetensors").is_file()
    # WHEN it is loaded back
    loaded = load_model(tmp_path)
    # THEN it computes exactly the same logits
    tokens = [5, 17, 200, 3, 3, 9]
    assert torch.equal(forward_reference(model, tokens), forward_reference(loaded, tokens))
    if tied:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


@pytest.mark.slow
def test_a_large_checkpoint_loads_through_meta_parameters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN a checkpoint counted as large, so the model is built on the meta device
    monkeypatch.setattr(checkpoint, "LARGE_MODEL_PARAMS", 0)
    model = tiny_model(4, ModelConfig(tie_word_embeddings=True))
    save_model(model, tmp_path)
    loaded = load_model(tmp_path)
    # THEN every weight is real, ties hold, and the logits are the same
    assert not any(p.is_meta for p in loaded.parameters())
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    tokens = [9, 8, 7, 6]
    assert torch.equal(forward_reference(model, tokens), forward_reference(loaded, tokens))


def test_loading_in_bfloat16_keeps_rope_in_float32(tmp_path: Path) -> None:
    save_model(tiny_model(0), tmp_path)
    model = load_model(tmp_path, dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.inv_freq.dtype == torch.float32
    assert forward_reference(model, [1, 2, 3]).shape == (3, 256)


def test_a_directory_without_config_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(ServeError, match="no config.json"):
        load_model(tmp_path)


def test_weights_that_do_not_match_the_config_are_a_user_error(tmp_path: Path) -> None:
    save_model(tiny_model(0), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ServeError, match="do not match"):
        load_model(tmp_path)


def test_the_tiny_model_is_seeded() -> None:
    a, b, c = tiny_model(0), tiny_model(0), tiny_model(1)
    tokens = [1, 2, 3, 4]
    assert torch.equal(forward_reference(a, tokens), forward_reference(b, tokens))
    assert not torch.equal(forward_reference(a, tokens), forward_reference(c, tokens))


def test_causal_attention_matches_a_naive_loop() -> None:
    # GIVEN 4 query heads over 2 kv heads
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, h, 8, generator=g) for h in (4, 2, 2))
    out = causal_attention(q, k, v)
    for t in range(5):
        for h in range(4):
            kv = h // 2
            weights = torch.softmax(k[: t + 1, kv] @ q[t, h] / 8**0.5, dim=0)
            assert torch.allclose(out[t, h], weights @ v[: t + 1, kv], atol=1e-5)


def test_logits_of_a_prefix_do_not_depend_on_later_tokens() -> None:
    model = tiny_model(0)
    full = forward_reference(model, [4, 8, 15, 16, 23, 42])
    prefix = forward_reference(model, [4, 8, 15])
    assert torch.allclose(full[:3], prefix, atol=1e-5)


def test_greedy_reference_generation_is_the_argmax_chain() -> None:
    model = tiny_model(0)
    out = generate_reference(model, [1, 2, 3], 5)
    tokens = [1, 2, 3]
    for token in out:
        assert token == int(forward_reference(model, tokens)[-1].argmax())
        tokens.append(token)


def test_llama3_rope_scaling_slows_only_low_frequencies() -> None:
    base = ModelConfig(head_dim=64, rope_theta=500000.0)
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    plain, scaled = rope_frequencies(base), rope_frequencies(base.replace(rope_scaling=scaling))
    assert torch.equal(plain[:4], scaled[:4])
    assert torch.allclose(scaled[-1], plain[-1] / 8.0)
    with pytest.raises(ValueError, match="unsupported rope_scaling"):
        rope_frequencies(base.replace(rope_scaling={"rope_type": "yarn", "factor": 2.0}))


def test_hf_config_round_trip() -> None:
    config = ModelConfig(num_heads=8, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
    assert ModelConfig.from_hf(config.to_hf()) == config


def test_model_parameter_names_are_the_hugging_face_ones() -> None:
    names = set(LlamaModel(ModelConfig(num_layers=1)).state_dict())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert "model.layers.0.post_attention_layernorm.weight" in names


def test_fused_projections_give_the_same_logits_and_keep_the_weights() -> None:
    # GIVEN the tiny model and a copy of it
    plain = tiny_model(7)
    fused = tiny_model(7)
    before = {k: v.clone() for k, v in fused.state_dict().items()}
    # WHEN the copy's q/k/v and gate/up projections are fused
    fused.fuse()
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    # THEN its logits are the plain model's, up to float32 rounding
    assert torch.allclose(
        forward_reference(fused, tokens), forward_reference(plain, tokens), atol=1e-5
    )
    # AND its parameters keep their names and values, now views of the fused weights
    after = fused.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    attn = fused.model.layers[0].self_attn
    assert attn.qkv is not None
    assert attn.k_proj.weight.data_ptr() == attn.qkv[attn.q_proj.weight.shape[0] :].data_ptr()
