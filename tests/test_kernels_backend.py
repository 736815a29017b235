"""Backend selection: Triton on CUDA, torch on CPU, KVSCOPE_KERNELS to force either."""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels import backend_name, paged_decode, paged_decode_ref
from tests.kernels_cases import HAS_CUDA, INTERPRETING, make_case


def test_cpu_tensors_use_the_torch_reference_by_default(monkeypatch):
    monkeypatch.delenv("KVSCOPE_KERNELS", raising=False)
    assert backend_name(torch.zeros(1)) == "torch"
    monkeypatch.setenv("KVSCOPE_KERNELS", "auto")
    assert backend_name(torch.zeros(1)) == "torch"


def test_forcing_torch_wins_everywhere(monkeypatch):
    monkeypatch.setenv("KVSCOPE_KERNELS", "torch")
    assert backend_name(torch.zeros(1)) == "torch"
    if HAS_CUDA:
        assert backend_name(torch.zeros(1, device="cuda")) == "torch"


@pytest.mark.skipif(INTERPRETING, reason="the interpreter is on in this process")
def test_forcing_triton_on_cpu_without_the_interpreter_says_how_to_fix_it(monkeypatch):
    monkeypatch.setenv("KVSCOPE_KERNELS", "triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend_name(torch.zeros(1))


@pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1 at triton import")
def test_forcing_triton_on_cpu_with_the_interpreter_runs_triton(monkeypatch):
    monkeypatch.setenv("KVSCOPE_KERNELS", "triton")
    assert backend_name(torch.zeros(1)) == "triton"


def test_unknown_backend_is_rejected(monkeypatch):
    monkeypatch.setenv("KVSCOPE_KERNELS", "cuda-magic")
    with pytest.raises(ValueError, match="auto, triton, torch"):
        backend_name(torch.zeros(1))


def test_public_function_on_cpu_equals_its_reference(monkeypatch):
    monkeypatch.delenv("KVSCOPE_KERNELS", raising=False)
    case = make_case([5, 9], 8, 2, 16, torch.float16)
    q = torch.randn(2, 4, 16, dtype=torch.float16)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    assert torch.equal(paged_decode(*args), paged_decode_ref(*args))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_tensors_use_triton_by_default(monkeypatch):
    monkeypatch.delenv("KVSCOPE_KERNELS", raising=False)
    assert backend_name(torch.zeros(1, device="cuda")) == "triton"


def test_programmatic_dependent_launch_only_where_the_device_has_it():
    from kvscope.kernels.backend import has_pdl

    assert not has_pdl(torch.device("cpu"))
    if HAS_CUDA and not INTERPRETING:
        major = torch.cuda.get_device_capability()[0]
        assert has_pdl(torch.device("cuda")) == (major >= 9)
