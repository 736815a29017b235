"""A device tensor brought to the host behind the work queued so far on the step's stream, and
waited for later (`HostCopy`): the host goes on with its own work while the GPU gets there.

    copy = HostCopy(device)
    host = copy.start(tokens)   # queued (into a buffer kept between steps: page-locked on CUDA)
    ...                         # the host's own work; what it queues on the stream comes after
    copy.wait()                 # host now holds the values
"""

from __future__ import annotations

import torch
from torch import Tensor


class HostCopy:
    """One copy at a time: `start` hands back a view of a buffer of its own (page-locked on
    CUDA) that the next `start` writes over, so its values are read before then. Off CUDA the
    copy is made at once (the tensor may be a buffer its kernels write again, such as the
    step graphs' error buffer) and `wait` has nothing to wait for."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.copied = torch.cuda.Event() if self.cuda else None
        # the stream the steps run on (asking for the current one at every step costs the host
        # a Stream object's making)
        self.stream = torch.cuda.current_stream(device) if self.cuda else None
        # page-locked buffers by dtype, grown as needed (a new one each step would cost the
        # host an allocation of pinned memory)
        self.buffers: dict[torch.dtype, Tensor] = {}

    def start(self, tensor: Tensor) -> Tensor:
        """Queue the copy of `tensor` to the host; the host tensor it goes to."""
        n = tensor.numel()
        flat = self.buffers.get(tensor.dtype)
        if flat is None or flat.numel() < n:
            size = max(n, 2 * flat.numel() if flat is not None else 64)
            flat = self.buffers[tensor.dtype] = torch.empty(
                size, dtype=tensor.dtype, pin_memory=self.cuda
            )
        host = flat[:n].view(tensor.shape)
        host.copy_(tensor, non_blocking=self.cuda)
        if self.copied is not None:
            self.copied.record(self.stream)
        return host

    def wait(self) -> None:
        """Until the last copy started is on the host."""
        if self.copied is not None:
            self.copied.synchronize()
