"""Backend choice: Triton on CUDA, the torch reference on CPU, overridable by environment.

`KVSCOPE_KERNELS=triton` forces Triton (with `TRITON_INTERPRET=1` it runs on CPU through the
interpreter), `KVSCOPE_KERNELS=torch` forces the reference; unset or `auto` picks by device.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import numpy as np

BACKEND_ENV = "KVSCOPE_KERNELS"
BACKENDS = ("auto", "triton", "torch")


def interpreting() -> bool:
    """Whether Triton runs through its CPU interpreter.

    Triton decides this when it is imported (`@triton.jit`, its own standard library included,
    reads `TRITON_INTERPRET` at decoration time), so the variable must be set before the first
    `import triton` in the process; setting it later has no effect.
    """
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.cdiv, InterpretedFunction)


def backend_name(tensor: torch.Tensor) -> str:
    """The backend (`"triton"` or `"torch"`) that a kernel called on `tensor` will use."""
    mode = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if mode not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={mode!r}: expected one of {', '.join(BACKENDS)}")
    if mode == "torch":
        return "torch"
    if mode == "triton":
        if not tensor.is_cuda and not interpreting():
            raise RuntimeError(
                f"{BACKEND_ENV}=triton: Triton runs on CUDA tensors, or on CPU tensors only "
                "when TRITON_INTERPRET=1 was set before triton was imported; "
                "unset it to use the torch reference"
            )
        return "triton"
    return "triton" if tensor.is_cuda else "torch"


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the Triton kernel should run for inputs living where `tensor` lives."""
    return backend_name(tensor) == "triton"


def has_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` can be programmatic dependent launches (`griddepcontrol`:
    compute capability 9.0 and up; never under the CPU interpreter)."""
    if device.type != "cuda" or interpreting():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a nominal 8 on CPU)."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor copied to `device` without the host waiting for the GPU.

    A CUDA copy from pageable memory waits for the stream to reach it, i.e. for every kernel
    queued before it (a step's whole forward); from page-locked memory it is queued like a
    kernel. torch's page-locked allocator keeps the staging memory until the copy has run.
    """
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def block_ids(
    blocks: torch.Tensor | Sequence[int] | np.ndarray, device: torch.device
) -> torch.Tensor:
    """Block ids (a list, numpy array or tensor) as a flat int64 tensor on `device`, uploaded
    without the host waiting (`upload`)."""
    if isinstance(blocks, torch.Tensor) and blocks.device.type != "cpu":
        return blocks.reshape(-1).to(device=device, dtype=torch.long)
    return upload(torch.as_tensor(blocks, dtype=torch.long).reshape(-1), device)


@contextlib.contextmanager
def serial_cpu(tensor: torch.Tensor) -> Iterator[None]:
    """Run the torch ops of the block on one thread when `tensor` is on the CPU.

    kvscope's own work on a CPU pool's K/V (canary fill and scan, poison, digests) runs inside
    the user's processes. torch's CPU ops use GNU OpenMP, which is not fork-safe: once a process
    has run a parallel region, a child it forks waits forever in its first one. A probe must not
    start that thread pool in a parent that would not have had it, nor enter it in a forked
    child (where the parent's pool may already exist), so its ops run on the calling thread.
    """
    if tensor.device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
