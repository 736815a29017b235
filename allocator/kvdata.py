"""The KV data tensor: a shared file on CPU, a CUDA IPC allocation on GPU.

Shape `[num_layers, 2, num_blocks, slots_per_block, num_kv_heads, head_dim]` (K and V).
"""

from __future__ import annotations

import io
import os
import pickle

import torch

from kvscope.allocator.config import PoolConfig
from kvscope.allocator.errors import PoolError
from kvscope.allocator.geometry import ELEMENT_BYTES
from kvscope.allocator.segment import check_size, create_file, open_file

IPC_MAX = 1024

# Sizes are computed without torch (geometry.ELEMENT_BYTES): keep that table true.
if {
    k: torch.empty((), dtype=getattr(torch, k)).element_size() for k in ELEMENT_BYTES
} != ELEMENT_BYTES:
    raise ImportError("geometry.ELEMENT_BYTES disagrees with torch's element sizes")


def kv_shape(cfg: PoolConfig) -> tuple[int, ...]:
    """[layers, 2, blocks, slots, kv_heads, head_dim]."""
    return (
        cfg.num_layers,
        2,
        cfg.num_blocks,
        cfg.slots_per_block,
        cfg.num_kv_heads,
        cfg.head_dim,
    )


def check_fits(cfg: PoolConfig, shm_free: int, meta_bytes: int) -> None:
    """Raise PoolError when the geometry cannot fit in the memory it would live in."""
    need = cfg.data_bytes
    if cfg.device == "cpu":
        if need + meta_bytes > shm_free:
            raise PoolError(
                f"pool needs {(need + meta_bytes) / 2**30:.2f} GiB of shared memory but only "
                f"{shm_free / 2**30:.2f} GiB is free in /dev/shm; use fewer blocks or layers"
            )
        return
    if meta_bytes > shm_free:
        raise PoolError(
            f"pool metadata needs {meta_bytes / 2**20:.1f} MiB of shared memory, only {shm_free / 2**20:.1f} MiB free"
        )
    if not torch.cuda.is_available():
        raise PoolError(f"device {cfg.device!r} requested but CUDA is not available here")
    dev = torch.device(cfg.device)
    free, _total = torch.cuda.mem_get_info(dev)
    if need > free:
        raise PoolError(
            f"pool needs {need / 2**30:.2f} GiB on {cfg.device} but only {free / 2**30:.2f} GiB is free"
        )


def create_cpu(path: str, cfg: PoolConfig) -> torch.Tensor:
    """Create the shared data file and map it as the KV tensor (zero-filled)."""
    fd = create_file(path, cfg.data_bytes, cfg.group)
    try:
        return _map_fd(fd, kv_shape(cfg), cfg.torch_dtype)
    finally:
        os.close(fd)


def attach_cpu(
    path: str, cfg: PoolConfig, owner: int = -1, trust_owner: bool = False
) -> torch.Tensor:
    """Map an existing CPU data file: a regular file (never through a symlink) of the segment's
    owner, at least as long as the geometry needs (a shorter one would SIGBUS on first touch).

    Args:
        owner: the uid that owns the pool's segment (default: this process's user).
        trust_owner: accept a file of another user (with `owner` naming that user).
    """
    fd = open_file(
        path,
        "",
        trust_owner=trust_owner,
        missing=f"the pool's data file {path} is missing; the pool is unusable",
        owner=os.geteuid() if owner < 0 else owner,
    )
    try:
        check_size(fd, cfg.data_bytes, path)
        return _map_fd(fd, kv_shape(cfg), cfg.torch_dtype)
    finally:
        os.close(fd)


def _map_fd(fd: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Map the file open on fd; through /proc/self/fd so that no path is looked up again."""
    numel = 1
    for s in shape:
        numel *= s
    flat = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=dtype)
    return flat.view(shape)


class _PlainUnpickler(pickle.Unpickler):
    """Loads only plain data (tuples, ints, bytes, bools): a CUDA IPC handle needs no class,
    and a segment's bytes must never name code to run."""

    def find_class(self, module: str, name: str):  # type: ignore[no-untyped-def]
        raise PoolError(
            f"the pool's CUDA IPC handle names {module}.{name}; a handle holds only plain data, so the segment was tampered with"
        )


def create_cuda(cfg: PoolConfig) -> tuple[torch.Tensor, bytes]:
    """Allocate the KV tensor on the GPU and return it with its pickled CUDA IPC handle."""
    kv = torch.zeros(kv_shape(cfg), dtype=cfg.torch_dtype, device=cfg.device)
    storage = kv.untyped_storage()
    handle = storage._share_cuda_()
    blob = pickle.dumps((handle, kv.storage_offset()))
    if len(blob) > IPC_MAX:
        raise PoolError(f"CUDA IPC handle too large ({len(blob)} bytes)")
    return kv, blob


def attach_cuda(blob: bytes, cfg: PoolConfig) -> torch.Tensor:
    """Open the creator's KV tensor from its IPC handle (CUDA must be initialised first)."""
    if not torch.cuda.is_available():
        raise PoolError(f"pool lives on {cfg.device} but CUDA is not available in this process")
    torch.cuda.init()
    try:
        handle, offset = _PlainUnpickler(io.BytesIO(blob)).load()
    except PoolError:
        raise
    except Exception:
        raise PoolError(
            "the pool's CUDA IPC handle is unreadable; the segment is damaged"
        ) from None
    shape = kv_shape(cfg)
    stride = torch.empty(shape, device="meta").stride()
    try:
        storage = torch.UntypedStorage._new_shared_cuda(*handle)
        kv = torch.empty(0, dtype=cfg.torch_dtype, device=cfg.device)
        kv.set_(storage, offset, shape, stride)
    except (RuntimeError, TypeError, ValueError) as e:
        # A creator that has exited, another device, or a handle that is not one.
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PoolError(
            f"cannot open the pool's KV tensor on {cfg.device} from its CUDA IPC handle ({first});"
            " the creating process must still run"
        ) from None
    return kv
