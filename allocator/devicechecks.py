"""The C core's checks of a CUDA pool's K/V, whose answers are read later so that no operation
waits for the GPU (csrc/devchecks.c, csrc/devanswers.c; docs/FORMAT.md "The core"): configured
for a handle here, their answers applied by the core at `settle`.

The core launches each check of its operations itself (one `cuLaunchKernel` of kernels/checks.py's
compiled kernel: the function handles, launch geometry and parameters Triton gave it), writing the
blocks' ids, and the records a finding would report, into a page-locked ring of its own. A check
is launched on the current stream, where it runs after every write enqueued before it and before
every write enqueued after it, so it sees the K/V as the operation did.

`settle()` has the core take the answers the GPU is past, oldest first (the checks an event
covers: a settle records one over the checks launched since the last where no older one is
outstanding, and queries it), and apply them itself: a
digest written into the record of the block it was taken of (in a transaction of the core under
the block's shard lock, only while the block is still published in the same generation: until
then the block has no digest and is not verified), a finding written into the findings ring
with the block's record as the operation saw it (the binding hands it to `on_finding` as every
finding the core writes). `settle(wait=True)` waits for every answer. Where the core's queue or
ring is full, it waits for the oldest answers itself, inside the operation, and applies them at
the next settle.

`settle` runs between operations only: at a request's allocation, free or abort, at the end of
an append or publication where more than MAX_PENDING answers wait, and, waiting, at
`pool.verify()`, `pool.check()` and close. A finding is therefore reported at the first of those
after the GPU produced its answer and the event covering it was recorded (on a CUDA pool, a
later settle where an older event was still outstanding at the first), not inside the operation
that launched the check.

Configuring fails with a RuntimeError where the core cannot launch the check kernel (no Triton,
a compiled kernel that is not plain, a launch from C that does not give Triton's answer): guard
mode and the digest probe are then not to be had on that pool. A CUDA driver error later turns
the checks off for the handle, with a RuntimeWarning once (the core's `device_stats()["broken"]`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from kvscope.allocator.handle import OwnerRef, PoolHandle

if TYPE_CHECKING:
    from kvscope.allocator.probeflags import ProbeFlags

# Answers waiting past this many are taken at the end of the operation that queued the last
# (pool.append, mark_computed: a program that publishes but never allocates or frees would pile
# them up), the oldest waited for where the GPU is that far behind.
MAX_PENDING = 4096
# int64 words of the core's ring (ids in, answers out, and the records a finding reports):
# 2 MiB of page-locked memory per handle
RING_WORDS = 1 << 18
# A test seam, not a setting: True makes a CPU pool's core queue its checks as a CUDA pool's
# (answered at once with the core's loops over the bytes, applied at the next settle), so the
# CPU tests run this queue without a GPU. Read when a handle's core is made (native.kv_layout)
# and its probes set.
DEFERRED_ON_CPU = False


class DeviceChecks:
    """The core's queue of one pool handle's checks of the K/V (a CUDA pool's)."""

    pool = OwnerRef()  # (the pool's probes hold this as `later`)

    def __init__(self, pool: PoolHandle, flags: ProbeFlags):
        self.pool = pool
        self.flags = flags
        self.cuda = self.pool.kv.device.type == "cuda"
        self.core: Any = self.pool.core
        self.settling = False
        self._configure()

    def _configure(self) -> None:
        """Configure the core's queue: on a GPU through the check kernel, compiled (or loaded)
        here for the modes the probes use, and its launch from C compared with Triton's."""
        import torch

        pool, core = self.pool, self.core
        ring = torch.zeros(RING_WORDS, dtype=torch.int64)
        config: dict[str, Any] = {
            "max_pending": MAX_PENDING,
            "ring_words": RING_WORDS,
            "kv": pool.kv,
            "kv_ptr": pool.kv.data_ptr(),
        }
        checks = None
        if self.cuda:
            ring = ring.pin_memory()
            checks = self._kernel(ring)
            device = pool.kv.device
            config.update(checks.native_launch(ring) or {}, cuda=True, device=device.index)
            # the current stream's raw handle, looked up by the core at each launch: torch's
            # own call, bound to the device (kernels/checks.py raw_stream's, without a Python
            # frame in between: a step launches several checks)
            config["stream"] = functools.partial(torch._C._cuda_getCurrentRawStream, device.index)
            if "functions" not in config:
                raise RuntimeError(
                    "kvscope: guard mode and the digest probe on a CUDA pool need the C core "
                    "to launch the check kernel, and this Triton's compiled kernel is not one "
                    "it can launch (kernels/checks.py native_launch)"
                )
        elif not pool.kv.is_contiguous():
            raise RuntimeError("kvscope: the K/V checks need a contiguous K/V tensor")
        else:
            config["cuda"] = False
        config.update(ring=ring, ring_ptr=ring.data_ptr())
        with pool.op_mutex:
            if core.device_stats() is not None:
                # probes set again on the handle: what the last queue holds is applied first
                # (the core takes one configuration at a time)
                self._settle(wait=True)
            core.device_checks(config)
            if checks is not None:
                from kvscope.kernels.checks import DIGEST

                try:
                    same = core.device_test(DIGEST, 0) == checks.block0_digest
                except RuntimeError:
                    same = False
                if not same:
                    core.device_checks(None)
                    raise RuntimeError(
                        "kvscope: guard mode and the digest probe on a CUDA pool need the C "
                        "core's launch of the check kernel to give Triton's answer, and it does "
                        "not with this Triton (kernels/checks.py native_launch)"
                    )

    def _kernel(self, ring: Any) -> Any:
        """The check kernel for the pool's K/V, each mode the probes use compiled (or loaded)
        as the handle opens: a kernel's first launch in a process loads it (Triton's, from its
        cache: a tenth of a second or more), which would otherwise stall the first operation
        that needs it, mid-serving."""
        import torch

        try:
            from kvscope.kernels import checks
        except ImportError as e:
            raise RuntimeError(
                "kvscope: guard mode and the digest probe on a CUDA pool need Triton (the "
                f"check kernel the C core launches): {e}"
            ) from e
        kv, flags = self.pool.kv, self.flags
        kernel = checks.Checks(kv, ring, self.pool.block_size)
        modes = [checks.DIGEST] if flags.digest else []
        if flags.guard:
            # (CANARY_POISON: a release's canaries and fill, one launch)
            modes += [checks.CANARY, checks.COUNTS, checks.POISON, checks.CANARY_POISON]
        # slot provenance's K/V hashes (csrc/provenance.c), taken by this queue wherever it is
        # configured: provenance may be turned on at any time (pool.provenance_sample); with the
        # digest, a publication's digests and hashes in one launch (DIGEST_SLOTS)
        modes.append(checks.SLOTS)
        if flags.digest:
            modes.append(checks.DIGEST_SLOTS)
        kernel.warm_up(modes)
        torch.cuda.synchronize(kv.device)
        return kernel

    def waiting(self) -> int:
        """How many checks' answers the core has not applied yet."""
        stats = self.core.device_stats()
        return 0 if stats is None else stats["waiting"] + stats["unapplied"]

    # -- their answers -----------------------------------------------------------------------------

    def settle(self, wait: bool = False, most: int | None = None) -> None:
        """Have the core apply the answers that are in (every answer, waiting for them, with
        `wait`; the oldest, waiting for them, until no more than `most` are left)."""
        if self.settling:
            return
        # Under the handle's op mutex, as the checks were queued (inside the core's operations):
        # two threads never take the same answer, nor one half-queued.
        with self.pool.op_mutex:
            self._settle(wait, most)
        self.pool.deliver_findings()

    def settle_overdue(self) -> None:
        """Between operations, where more than MAX_PENDING answers wait: `settle`, waiting for
        the oldest where the GPU is still that far behind."""
        self.settle(most=MAX_PENDING)

    def _settle(self, wait: bool, most: int | None = None) -> None:
        self.settling = True
        try:
            self.core.device_take(self.pool, wait, -1 if most is None else most)
        finally:
            self.settling = False


def for_pool(pool: PoolHandle, flags: ProbeFlags) -> DeviceChecks | None:
    """The queue of a handle whose probes (`flags`) check its K/V through it (guard mode or the
    digest probe on a pool whose K/V the core does not map: a CUDA pool; a CPU pool under
    DEFERRED_ON_CPU), configured; else None, and a queue an earlier probe set configured is
    applied and let go."""
    if (flags.digest or flags.guard) and (pool.kv.device.type == "cuda" or DEFERRED_ON_CPU):
        return DeviceChecks(pool, flags)
    core = pool.core
    if core.device_stats() is not None:
        with pool.op_mutex:
            core.device_take(pool, True, -1)
            core.device_checks(None)
        pool.deliver_findings()
    return None
