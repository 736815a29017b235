"""A device tensor brought to the host behind the work queued so far on the step's stream, and
waited for later (`HostCopy`): the host goes on with its own work while the GPU gets there; and
a step's few host integers sent to the device without waiting for the GPU (`upload`).

    copy = HostCopy(device)
    rows = copy.upload([3, 7, 9])   # on the device, queued (the host does not wait)
    host = copy.start(tokens)       # queued (into a buffer kept between steps: page-locked on CUDA)
    ...                             # the host's own work; what it queues on the stream comes after
    copy.wait()                     # host now holds the values
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
        # their views by (dtype, shape), made once (a slice and a view cost the host more
        # than the copy's own call)
        self.views: dict[tuple[torch.dtype, torch.Size], Tensor] = {}
        # upload's page-locked staging and its device buffer
        self.staged: Tensor | None = None
        self.uploaded: Tensor | None = None

    def start(self, tensor: Tensor) -> Tensor:
        """Queue the copy of `tensor` to the host; the host tensor it goes to."""
        key = (tensor.dtype, tensor.shape)
        host = self.views.get(key)
        if host is None:
            n = tensor.numel()
            flat = self.buffers.get(tensor.dtype)
            if flat is None or flat.numel() < n:
                size = max(n, 2 * flat.numel() if flat is not None else 64)
                flat = self.buffers[tensor.dtype] = torch.empty(
                    size, dtype=tensor.dtype, pin_memory=self.cuda
                )
                self.views = {k: v for k, v in self.views.items() if k[0] != tensor.dtype}
            host = self.views[key] = flat[:n].view(tensor.shape)
        host.copy_(tensor, non_blocking=self.cuda)
        if self.copied is not None:
            self.copied.record(self.stream)
        return host

    def upload(self, values: list[int]) -> Tensor:
        """`values` as an int64 tensor on the device, its copy queued on the stream. From a
        page-locked buffer, written again at the next upload: the caller waits for work queued
        after this copy (its `start`'s) before that. (A tensor made from a list is pageable
        memory: its copy waits for everything queued before it, the step's whole forward.)"""
        if not self.cuda:
            return torch.tensor(values, dtype=torch.int64)
        n = len(values)
        if self.staged is None or self.staged.numel() < n:
            size = max(n, 64, 2 * (self.staged.numel() if self.staged is not None else 0))
            self.staged = torch.empty(size, dtype=torch.int64, pin_memory=True)
            self.uploaded = torch.empty(size, dtype=torch.int64, device=self.stream.device)
        assert self.uploaded is not None
        self.staged.numpy()[:n] = values
        out = self.uploaded[:n]
        out.copy_(self.staged[:n], non_blocking=True)
        return out

    def wait(self) -> None:
        """Until the last copy started is on the host."""
        if self.copied is not None:
            self.copied.synchronize()
