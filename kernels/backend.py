"""Backend choice: Triton on CUDA, the torch reference on CPU, overridable by environment.

`KVSCOPE_KERNELS=triton` forces Triton (with `TRITON_INTERPRET=1` it runs on CPU through the
interpreter), `KVSCOPE_KERNELS=torch` forces the reference; unset or `auto` picks by device.
"""

from __future__ import annotations

import os

import torch

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
