"""A pool's life: create, attach, this process's client record, what comes before a close,
unlink, and reclaiming what dead processes left. The `KVPool` methods of the same names
(pool.py) call these, through the handle's public members (allocator/handle.py PoolHandle);
the detach and reclaiming are the C core's (csrc/recovery.c)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from kvscope.allocator import kvdata, ofd, recovery
from kvscope.allocator.config import (
    MAX_EVENT_CAPACITY,
    KVEventsConfig,
    PoolConfig,
    check_kv_events,
)
from kvscope.allocator.errors import PoolError
from kvscope.allocator.header import config_from_header, init_segment, seal_header
from kvscope.allocator.layout import COUNTER_FIELDS, ClientState, Layout, SegmentView
from kvscope.allocator.probeflags import GUARD_SAMPLE_ENV, env_flag
from kvscope.allocator.process import now_ns
from kvscope.allocator.segment import (
    check_name,
    data_path,
    map_new,
    open_existing,
    release,
    remove_if_created,
    segment_path,
    shm_free_bytes,
    view_of,
)

if TYPE_CHECKING:
    from kvscope.allocator.handle import PoolHandle

# The handle class a pool is made as (KVPool).
P = TypeVar("P", bound="PoolHandle")


def event_capacity_floor() -> int:
    """KVSCOPE_EVENT_CAPACITY (0 when unset): the least events each process's flight recorder
    keeps; PoolError for a value that is not a count PoolConfig.event_capacity accepts."""
    raw = os.environ.get("KVSCOPE_EVENT_CAPACITY", "")
    try:
        n = int(raw or 0)
    except ValueError:
        n = -1
    if not 0 <= n <= MAX_EVENT_CAPACITY:
        raise PoolError(
            f"KVSCOPE_EVENT_CAPACITY={raw!r}: give a number of events from 0 to {MAX_EVENT_CAPACITY}"
        )
    return n


def create(cls: type[P], name: str, config: PoolConfig, restore: Any = None) -> P:
    """A new pool named `name` (`KVPool.create`); PoolError if one exists or it cannot fit.
    With `restore` (a checkpoint.Snapshot: `KVPool.restore`), its metadata is the snapshot's,
    written into the new segment before any handle attaches (as init_segment writes it), and
    the handle made takes over the client record of the snapshot's writer."""
    check_name(name)
    cfg = config.resolved()
    # Under `kvscope run --guard` (KVSCOPE_GUARD=1) every pool gets guard slots.
    cfg.guard = cfg.guard or env_flag("GUARD")
    cfg.events = cfg.events or env_flag("EVENTS")
    cfg.lockdep = cfg.lockdep or env_flag("LOCKDEP")
    if cfg.guard and not cfg.quarantine:
        cfg.quarantine = int(os.environ.get("KVSCOPE_QUARANTINE", "0") or 0)
    # Under `kvscope run` each process's flight recorder keeps at least this many events
    # (a floor: a larger event_capacity of the program's stays).
    cfg.event_capacity = max(cfg.event_capacity, event_capacity_floor())
    layout = Layout(
        cfg.num_blocks,
        cfg.block_size,
        cfg.max_seqs,
        cfg.max_blocks_per_seq,
        cfg.max_clients,
        cfg.num_shards,
        cfg.event_capacity,
    )
    size = layout.offsets()["end"]
    kvdata.check_fits(cfg, shm_free_bytes(), size)
    path = segment_path(name)
    mf = map_new(path, size, cfg.group)
    try:
        view = SegmentView(mf.mm, layout)
        init_segment(view, cfg, name)
        if restore is not None:
            from kvscope.allocator import checkpoint
            from kvscope.allocator.process import my_identity

            try:
                checkpoint.restore(view, restore, *my_identity())
            except ValueError as e:
                raise PoolError(f"pool {name!r}: {e}") from None
        if cfg.device == "cpu":
            kv = kvdata.create_cpu(data_path(name), cfg)
        else:
            kv, blob = kvdata.create_cuda(cfg)
            view.header["cuda_ipc_len"] = len(blob)
            view.header["cuda_ipc"] = blob
        if cfg.guard:
            from kvscope.kernels import fill_guard
            from kvscope.kernels.backend import serial_cpu

            with serial_cpu(kv):  # (no OpenMP thread pool in a process that may fork)
                fill_guard(kv)
                if kv.dtype.is_floating_point:
                    # Token slots start poisoned, as freed ones are: K/V never written into a
                    # block shows as NaN, and is found when its request finishes (the core's free: csrc/entry.c finish_check).
                    kv[:, :, :, : cfg.block_size] = float("nan")
        seal_header(view)
    except BaseException:
        release(mf)
        for p in (path, data_path(name)):
            remove_if_created(p)
        raise
    pool = cls(name, mf, view, kv, created=True, client=-1 if restore is None else restore.client)
    if cfg.guard_sample > 1 and not os.environ.get(GUARD_SAMPLE_ENV):
        pool.guard_sample = cfg.guard_sample
    if cfg.record_ops:
        pool.record_ops(cfg.record_ops, limit=cfg.record_ops_limit)  # type: ignore[attr-defined]
    if cfg.kv_events:
        try:
            _start_kv_events(pool, cfg.kv_events)
        except PoolError:
            pool.close()
            pool.unlink()
            raise
    return pool


def attach(
    cls: type[P],
    name: str,
    trust_owner: bool = False,
    kv_events: str | KVEventsConfig = "",
    client: int = -1,
) -> P:
    """An existing pool by name (`KVPool.attach`; another user's only with `trust_owner`;
    `client`: a restored pool's client record to take over, register_client)."""
    check_name(name)
    check_kv_events(kv_events, what="KVPool.attach's kv_events")
    mf = open_existing(segment_path(name), name, trust_owner)
    try:
        view = view_of(mf)
        cfg = config_from_header(view.h)
        if cfg.device == "cpu":
            kv = kvdata.attach_cpu(data_path(name), cfg, mf.uid, trust_owner)
        else:
            blob = bytes(view.h["cuda_ipc"])[: int(view.h["cuda_ipc_len"])]
            kv = kvdata.attach_cuda(blob, cfg)
    except BaseException:
        release(mf)
        raise
    pool = cls(name, mf, view, kv, created=False, client=client)
    if kv_events:
        try:
            _start_kv_events(pool, kv_events)
        except PoolError:
            pool.close()
            raise
    return pool


def _start_kv_events(pool: PoolHandle, endpoint: str | KVEventsConfig) -> None:
    """Start the pool's KV-event publisher (docs/EVENTS.md); `close` stops it."""
    # The publisher is the harness's (kvscope/events/publisher.py, a floor above the pool): the
    # pool finds it through the package's entry point `kvscope.pool`/`kv_events`
    # (pyproject.toml), as pytest finds its plugins, so the allocator imports nothing above it;
    # zmq and the stream checker load only in a process whose pool publishes.
    from importlib.metadata import entry_points

    found = list(entry_points(group="kvscope.pool", name="kv_events"))
    if not found:
        raise PoolError(
            "PoolConfig.kv_events: kvscope's KV-event publisher is not registered in this "
            "environment (reinstall kvscope: pip install -e .)"
        )
    pool.kv_events = found[0].load()(pool, endpoint)


def register_client(
    pool: PoolHandle, mf: Any, bind: Callable[[int], None], client: int = -1
) -> int:
    """Claim a client record of the pool mapped by `mf` and bind the handle to it with `bind`
    (`KVPool._bind`): a never-used one first (dead ones stay for analysis), then a detached
    one; in a full table, one reclaimed from a dead process (`_reclaim_for_attach`).

    With `client`, that record, which a restore made this process's (checkpoint.restore: a
    replay's pool), taken over as it is: its local cache, counters and what it owns."""
    c = pool.view.clients
    if client >= 0:
        with _file_lock(mf, pool.view.offsets["clients"]):
            if not (
                client < len(c)
                and int(c["state"][client]) == ClientState.ATTACHED
                and (int(c["pid"][client]), int(c["start"][client])) == (pool.pid, pool.start)
                and client not in mf.__dict__.setdefault("taken_over", set())
            ):
                raise PoolError(
                    f"pool {pool.name!r}: client record {client} is not one to take over"
                )
            mf.__dict__["taken_over"].add(client)
            bind(client)
        return client
    with _file_lock(mf, pool.view.offsets["clients"]):
        states = c["state"]
        empty = np.flatnonzero(states == ClientState.EMPTY)
        if len(empty) == 0:
            empty = np.flatnonzero(states == ClientState.DETACHED)
        if len(empty):
            i = int(empty[0])
        else:
            got = _reclaim_for_attach(pool, bind)
            if got is None:
                raise PoolError(
                    f"pool {pool.name!r} has {len(states)} attached processes, all alive "
                    "(PoolConfig.max_clients); detach some, or create the pool with a larger "
                    "max_clients"
                )
            i = got
        rec = c[i : i + 1]
        rec["pid"], rec["start"] = pool.pid, pool.start
        # The attach time is also the record's attach generation: it never repeats, so a
        # reclaimer can tell this attach from an earlier one of the same process.
        rec["attached_ns"] = max(now_ns(), int(rec["attached_ns"][0]) + 1)
        rec["local_count"] = 0
        rec["journal_count"] = 0
        rec["journal_used"] = 0
        rec["event_count"] = 0
        rec["event_head"] = 0
        rec["op"] = 0
        # A record reused after a process died inside an operation keeps its odd seq: even
        # it out, or this process would look busy exactly while it is idle.
        rec["seq"] += rec["seq"] % 2
        for f in COUNTER_FIELDS:
            rec[f] = 0
        c["state"][i] = ClientState.ATTACHED
        # Bound once the record is this process's (its journal empty, as the parts read it).
        bind(i)
    return i


def _reclaim_for_attach(pool: PoolHandle, bind: Callable[[int], None]) -> int | None:
    """Free a client record for a process attaching to a full client table: the index of a
    dead client's record, reclaimed and detached, with the handle bound to it; None when
    every attached process is alive. The caller holds the registration lock, so no other
    attach takes the record meanwhile.

    The attacher has no record of its own to journal a reclaim in, so it borrows the dead
    one's: the handle binds to that record (its lock table, journal and core name it) and its
    core reclaims the record's dead owner there (csrc/recovery.c reclaim_for_attach: the same
    steps as any reclaim; the record's journal holds only its dead owner's entries, which the
    first step rolls back). The handle then claims the record and binds to it again, as a
    process of its own: no second kind of core."""
    for d in recovery.find_dead(pool.view):
        bind(d.client)
        with pool.op_mutex:  # (the mapping's, which another handle here may hold)
            got = pool.core.reclaim_for_attach(d.pid, d.start, d.generation)
        if got is not None:
            pool.reclaimed_at_attach.append({"pid": d.pid, **got, "detached": True})
            return d.client
        if int(pool.view.clients["state"][d.client]) == ClientState.DETACHED:
            # Another reclaimer finished it; no other attach can take it while we register.
            return d.client
    return None


@contextlib.contextmanager
def _file_lock(mf: Any, off: int) -> Iterator[None]:
    """A short exclusive section for client registration (the byte at `off`, the clients
    section's first, of the mapping `mf`)."""
    tl = mf.__dict__.setdefault("reg_lock", threading.Lock())
    with tl:
        ofd.lock(mf.fd, off, 1, wait=True)
        try:
            yield
        finally:
            ofd.unlock(mf.fd, off, 1)


def before_close(pool: P, hook: Callable[[P], None] | None) -> None:
    """What `KVPool.close` does before the core detaches the handle: the probes' answers
    settled, the KV-event publisher stopped, then `hook` sees the pool (pool.CLOSE_HOOK)."""
    if pool.probe is not None:
        pool.probe.settle(wait=True)
    if pool.kv_events is not None:
        # its last batch, and its check's findings before the hook reads the pool
        publisher, pool.kv_events = pool.kv_events, None
        publisher.close_with(pool)
    if hook is not None:
        hook(pool)


def unlink(pool: P, hook: Callable[[P], None] | None) -> None:
    """Remove the pool's files (`KVPool.unlink`), or only call `hook` (pool.UNLINK_HOOK)."""
    if hook is not None:
        hook(pool)
        return
    for p in (segment_path(pool.name), data_path(pool.name)):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def reclaim_dead(pool: PoolHandle, done: list[dict[str, Any]] | None) -> dict[str, int]:
    """`KVPool.reclaim_dead`: the core's (csrc/recovery.c), with the processes whose own exit
    already recorded what they held (their reclaim writes no second finding)."""
    with pool.op_mutex:
        totals, got = pool.core.reclaim_dead(recovery.said_at_exit(pool.view))
    if done is not None:
        done.extend(got)
    pool.deliver_findings()
    return totals
