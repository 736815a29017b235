"""The C core's own queue of a CUDA pool's checks (csrc/devchecks.c): configured for a handle by
its DeviceChecks (allocator/devicechecks.py), and its answers taken at that module's settle.

The core launches a check through the check kernel devicechecks compiled (kernels/checks.py
`native_launch`: the function handles, launch geometry and parameters Triton gave it), writing the
blocks' ids, and the records a finding would report, into a page-locked ring of its own; it is
used only where a digest of block 0 it launched equals the one Triton's launch gave at warm-up.
On a CPU pool under KVSCOPE_NATIVE_KV=deferred the same queue answers with the core's loops over
the bytes (the tests' way to run it without a GPU). devicechecks' own queue is the reference.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kvscope.allocator.devicechecks import DeviceChecks

# int64 words of the core's ring, which also keeps the records a finding reports: 2 MiB of
# page-locked memory per handle
CORE_RING_WORDS = 1 << 18


def configure(later: DeviceChecks, max_pending: int) -> None:
    """Configure the queue of `later`'s handle's C core for it (later.core: the core, once it
    launches the checks itself), where the core can make the launches; past `max_pending`
    checks waiting, the pool's next append or publication takes their answers."""
    import torch

    pool = later.pool
    core = pool._native
    assert core is not None, "configured once the handle's core is there"
    ring = torch.zeros(CORE_RING_WORDS, dtype=torch.int64)
    config: dict[str, Any] = {
        "max_pending": max_pending,
        "ring_words": CORE_RING_WORDS,
    }
    if later.cuda:
        ring = ring.pin_memory()
        launch = None if later._checks is None else later._checks.native_launch(ring)
        if launch is None:
            return
        from kvscope.kernels.checks import raw_stream

        device = pool.kv.device
        config.update(launch, cuda=True, device=device.index)
        config["stream"] = functools.partial(raw_stream, device)
    elif later._checks is not None or not pool.kv.is_contiguous():
        return  # (a CPU pool through the check kernel: the interpreter's way, in Python)
    else:
        config.update(cuda=False, kv=pool.kv, kv_ptr=pool.kv.data_ptr())
    config.update(ring=ring, ring_ptr=ring.data_ptr())
    with pool._mutex:
        if core.device_stats() is not None:
            # a probe set again on the handle: the checks the last one's queue still holds are
            # answered and reported here first (the core takes one configuration)
            later.core = core
            later._settle(wait=True)
            later.core = None
        core.device_checks(config)
        if later.cuda:
            from kvscope.kernels.checks import DIGEST

            try:
                same = core.device_test(DIGEST, 0) == later._checks.block0_digest
            except RuntimeError:
                same = False
            if not same:
                core.device_checks(None)
                return
    later.core = core  # (which keeps the ring: its configuration holds it)


def take(later: DeviceChecks, wait: bool, most: int | None) -> None:
    """The answers of the core's checks that are in (`device_take`, devicechecks.settle's
    `wait` and `most`): its digests, written into the records by the core (those it does not
    write now left for `later` to write), and what it found, reported as devicechecks' own
    queue reports it."""
    taken = later.core.device_take(wait, -1 if most is None else most, later.pool)
    if taken is None:
        return
    stamps, found = taken
    later._stamps += stamps
    dtype = later.pool.view.blocks.dtype
    bs = later.pool.block_size
    for kind, when, ids, answer, raw in found:
        if kind == "unwritten":  # (when: the request; raw: its positions to be written)
            blank = np.asarray(answer).reshape(len(ids), bs) == 0
            later._unwritten_read(blank, ids, raw, when)
            continue
        recs = np.frombuffer(raw, dtype=dtype).copy()
        if kind == "verify":
            later._verify_read(answer, ids, recs, when)
        elif kind == "poison":
            later._poison_read(np.asarray(answer), ids, recs)
        else:
            assert kind == "canary", kind
            later._canaries_read(np.asarray(answer), ids, recs)
