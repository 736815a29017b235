"""KVPool: the shared paged KV pool (create/attach, allocate, append, fork, free, stats, check)."""

from __future__ import annotations

import contextlib
import os
import threading
from array import array
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch

from kvscope.allocator import faults, kvdata, native, ofd
from kvscope.allocator.blocks import BlockStore
from kvscope.allocator.config import PoolConfig
from kvscope.allocator.errors import PoolError
from kvscope.allocator.header import config_from_header, init_segment, seal_header
from kvscope.allocator.journal import Journal
from kvscope.allocator.layout import (
    COUNTER_FIELDS,
    ClientState,
    Layout,
    SegmentView,
)
from kvscope.allocator.locks import HOOK_PROBE, HOOK_SITE, DeadHolder, LockTable, mark_hook
from kvscope.allocator.probing import (
    GUARD_SAMPLE_ENV,
    NATIVE_LOCKDEP,
    PoolProbes,
    ProbeFlags,
    env_flag,
    guard_sample_from_env,
)
from kvscope.allocator.process import my_identity, now_ns
from kvscope.allocator.recovery import (
    dead_owners,
    detach_client,
    reclaim_dead,
    reclaim_for_attach,
    recover_dead_holders,
)
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
from kvscope.allocator.seqops import SequenceOps
from kvscope.allocator.sequence import SeqTable, Sequence
from kvscope.allocator.txn import ClientSeq, Escalate, Txn

T = TypeVar("T")

# This process's pid, refreshed in a forked child (os.getpid() is a system call per operation).
_PID = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))


# Harness hooks, set by `kvscope run`'s bootstrap: each OPEN_HOOKS entry is called with every
# pool this process creates or attaches; CLOSE_HOOK, when set, with a pool about to be closed
# (its sequences still readable); UNLINK_HOOK, when set, is called instead of unlinking (the
# supervisor unlinks after it has dumped and analyzed the pool).
OPEN_HOOKS: list[Callable[[KVPool], None]] = []
CLOSE_HOOK: Callable[[KVPool], None] | None = None
UNLINK_HOOK: Callable[[KVPool], None] | None = None


class KVPool(SequenceOps):
    """A paged KV-cache pool in shared memory, usable by many processes at once."""

    def __init__(self, name: str, mf, view: SegmentView, kv: torch.Tensor, created: bool):
        self.name = name
        self._mf = mf
        self.view = view
        self.kv = kv
        self.created = created
        self.config = config_from_header(view.h)
        self.block_size = self.config.block_size
        self.slots_per_block = self.config.slots_per_block
        self.pid, self.start = my_identity()
        # One operation at a time per mapping (handles of one process on one pool share it and
        # its one open of the segment, whose OFD locks do not exclude each other).
        # Probe hooks set on this handle (bits of HOOK_*): the C core (native.py) runs only
        # while none is; `probe`, `site_of` and the lock table's hooks keep it up to date.
        self._hooks = array("q", [0])
        # Sampled guard mode (guard_sample): the allocation counter, and the slots of the
        # sequences it guards (their releases guard, poison and quarantine; others do not).
        self._guard_every = guard_sample_from_env()
        self._guard_tick = 0
        self._guarded: set[int] = set()
        # The light probes the C core runs itself for this handle (PoolProbes.native_bits).
        self._probe_bits = array("q", [0])
        self._mutex: threading.RLock = mf.__dict__.setdefault("op_mutex", threading.RLock())
        # How many Python-path operations are inside that mutex (0 or 1, or more when nested):
        # the C core (native.py) runs only while it is 0.
        self._busy: array = mf.__dict__.setdefault("op_busy", array("q", [0]))
        self._closed = False
        # Dead processes an attach to a full client table reclaimed (recovery.py).
        self.reclaimed_at_attach: list[dict[str, Any]] = []
        self.client = self._register_client()
        self._client_seq = ClientSeq(view, self.client)
        self.counters = {f: view.clients[f][self.client : self.client + 1] for f in COUNTER_FIELDS}
        self.journal = Journal(view, self.client)
        self.locks = LockTable(mf, view, self.pid, self.start, self.client, self._hooks)
        n_shards = view.layout.num_shards
        self.SEQS = self.locks.index("seqs")
        self.SHARDS = [self.locks.index(f"index.{i}") for i in range(n_shards)]
        self.FREE = self.locks.index("free")
        self.ALL = set(range(len(self.locks.names)))
        self.store = BlockStore(view, self.client, self.FREE, self.SHARDS)
        self.seqtab = SeqTable(view, self.SEQS, self.client)
        self._seqs: dict[int, Sequence] = {}
        self._uid = id(self)
        # Probe hooks: None when off (one attribute check per operation).
        self.site_of = None
        self.on_finding: Callable[[Any], None] | None = None
        flags = ProbeFlags.from_env(int(view.h["flags"]))
        self.probe = PoolProbes(self, flags) if flags.any() else None
        if self.probe is not None and self.probe.sites is not None:
            self.site_of = self.probe.sites.site
        # The C core for the common case of the hot operations (native.py), or None.
        self._native = native.core_for(self)
        for hook in OPEN_HOOKS:
            hook(self)

    # -- probe hooks -------------------------------------------------------------------------

    @property
    def probe(self) -> PoolProbes | None:
        """The probes watching this handle's operations (None when off)."""
        return self._probe

    @probe.setter
    def probe(self, value: PoolProbes | None) -> None:
        self._probe = value
        # Probes the C core runs itself keep it on; any other sends operations to Python.
        bits = 0 if value is None else value.native_bits()
        self._probe_bits[0] = max(bits, 0) | (self._probe_bits[0] & NATIVE_LOCKDEP)
        mark_hook(self._hooks, HOOK_PROBE, bits < 0)
        self._mark_site()

    @property
    def guard_sample(self) -> int:
        """Guard mode guards one allocation in this many (0 or 1: every one)."""
        return self._guard_every

    @guard_sample.setter
    def guard_sample(self, every: int) -> None:
        self._guard_every = every
        self.probe = self.probe  # the C core's share of the probes changes with it

    def _sample_guard(self) -> bool:
        """True for the allocation sampled guard mode guards (the first, then one in N)."""
        tick = self._guard_tick
        self._guard_tick = tick + 1
        return tick % self._guard_every == 0

    def _guards(self, slot: int) -> bool:
        """Whether guard mode guards the release of the sequence in `slot`."""
        return self._guard_every <= 1 or slot in self._guarded

    @property
    def site_of(self) -> Callable[[], int] | None:
        """Call-site recording: returns the site index of the current operation (None: off)."""
        return self._site_of

    @site_of.setter
    def site_of(self, value: Callable[[], int] | None) -> None:
        self._site_of = value
        self._mark_site()

    def _mark_site(self) -> None:
        """The C core records sites itself only for the ownership probe's site table."""
        fn = getattr(self, "_site_of", None)
        probe = getattr(self, "_probe", None)
        ours = probe is not None and probe.sites is not None and fn == probe.sites.site
        mark_hook(self._hooks, HOOK_SITE, fn is not None and not ours)

    # -- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def create(cls, name: str, config: PoolConfig) -> KVPool:
        """Create a new pool named `name`; PoolError if one exists or it cannot fit."""
        check_name(name)
        cfg = config.resolved()
        # Under `kvscope run --guard` (KVSCOPE_GUARD=1) every pool gets guard slots.
        cfg.guard = cfg.guard or env_flag("GUARD")
        cfg.events = cfg.events or env_flag("EVENTS")
        cfg.lockdep = cfg.lockdep or env_flag("LOCKDEP")
        if cfg.guard and not cfg.quarantine:
            cfg.quarantine = int(os.environ.get("KVSCOPE_QUARANTINE", "0") or 0)
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
            if cfg.device == "cpu":
                kv = kvdata.create_cpu(data_path(name), cfg)
            else:
                kv, blob = kvdata.create_cuda(cfg)
                view.header["cuda_ipc_len"] = len(blob)
                view.header["cuda_ipc"] = blob
            if cfg.guard:
                from kvscope.kernels import fill_guard

                fill_guard(kv)
                if kv.dtype.is_floating_point:
                    # Token slots start poisoned, as freed ones are: K/V never written into a
                    # block shows as NaN, and is found when its request finishes (writes.py).
                    kv[:, :, :, : cfg.block_size] = float("nan")
            seal_header(view)
        except BaseException:
            release(mf)
            for p in (path, data_path(name)):
                remove_if_created(p)
            raise
        pool = cls(name, mf, view, kv, created=True)
        if cfg.guard_sample > 1 and not os.environ.get(GUARD_SAMPLE_ENV):
            pool.guard_sample = cfg.guard_sample
        return pool

    @classmethod
    def attach(cls, name: str, trust_owner: bool = False) -> KVPool:
        """Attach to an existing pool by name (another user's only with `trust_owner`)."""
        check_name(name)
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
        return cls(name, mf, view, kv, created=False)

    def _register_client(self) -> int:
        """Claim a client record: a never-used one first (dead ones stay for analysis), then a
        detached one; in a full table, one reclaimed from a dead process (recovery.py)."""
        c = self.view.clients
        with self._file_lock():
            states = c["state"]
            empty = np.flatnonzero(states == ClientState.EMPTY)
            if len(empty) == 0:
                empty = np.flatnonzero(states == ClientState.DETACHED)
            if len(empty):
                i = int(empty[0])
            else:
                got = reclaim_for_attach(
                    self._mf, self.view, self.pid, self.start, self.reclaimed_at_attach
                )
                if got is None:
                    raise PoolError(
                        f"pool {self.name!r} has {len(states)} attached processes, all alive "
                        "(PoolConfig.max_clients); detach some, or create the pool with a larger "
                        "max_clients"
                    )
                i = got
            rec = c[i : i + 1]
            rec["pid"], rec["start"] = self.pid, self.start
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
        return i

    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        """A short exclusive section for client registration (a byte of the clients section)."""
        tl = self._mf.__dict__.setdefault("reg_lock", threading.Lock())
        off = self.view.offsets["clients"]
        with tl:
            ofd.lock(self._mf.fd, off, 1, wait=True)
            try:
                yield
            finally:
                ofd.unlock(self._mf.fd, off, 1)

    def close(self) -> None:
        """Detach: return this process's local cache and slot reserve, release the mapping."""
        if self._closed:
            return
        self._check_process()
        if CLOSE_HOOK is not None:
            CLOSE_HOOK(self)
        with self._mutex:
            if self.journal.count:
                self.journal.rollback()
            self._run({self.FREE}, self._flush_local)
            self.seqtab.reserve.clear()
            # The same journaled fold as reclaiming a dead process, under the lock that guards
            # the header's counters (the seqs lock), a chunk of reserved slots at a time.
            while not self._run({self.SEQS}, lambda t: detach_client(self.view, t, self.client)):
                pass
            self._closed = True
        if self._native is not None:
            self._native.close()
            self._native = None
        self.view = None  # type: ignore[assignment]
        release(self._mf)

    def _flush_local(self, t: Txn) -> None:
        ids = self.store.local_pop(t, len(self.store.local))
        if len(ids):
            self.store.ring_push(t, ids)

    def unlink(self) -> None:
        """Remove the pool's files; processes still attached keep their mappings until they close."""
        if UNLINK_HOOK is not None:
            UNLINK_HOOK(self)
            return
        for p in (segment_path(self.name), data_path(self.name)):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_process(self) -> None:
        if self._closed:
            raise PoolError(f"pool {self.name!r} is closed")
        if _PID[0] != self.pid:
            raise PoolError(
                f"this handle on pool {self.name!r} was opened by pid {self.pid}; "
                "in a forked child call KVPool.attach(name) instead"
            )
        # (after the checks above: the verification runs operations of its own)
        if self.probe is not None and self.probe.flags.magic:
            self.probe.verify_often()

    # -- the operation runner ------------------------------------------------------------------

    def _run(self, locks: set[int], fn: Callable[[Txn], T]) -> T:
        """Run fn in a transaction, escalating locks and recovering dead holders as needed."""
        self._check_process()
        with self._mutex:
            busy = self._busy
            busy[0] += 1
            try:
                while True:
                    try:
                        order: set[int] | list[int] = locks
                        invert = (
                            faults.ARMED and len(locks) > 1 and faults.opportunity("lock-inversion")
                        )
                        if invert:
                            order = sorted(locks, reverse=True)
                        with Txn(self.locks, self.journal, self._client_seq, order) as t:
                            if invert:
                                # Announced once the locks are taken in the wrong order.
                                faults.fired("lock-inversion")
                            return fn(t)
                    except Escalate as e:
                        locks = e.locks
                    except DeadHolder:
                        recover_dead_holders(self.locks, self.view, self.client, self.report)
            finally:
                busy[0] -= 1

    def _count(self, t: Txn, field: str, n: int = 1) -> None:
        """Add to a counter when (and only if) the transaction commits."""
        if n:
            t.after_commit.append(
                lambda: self.counters[field].__setitem__(0, self.counters[field][0] + n)
            )

    def _site(self) -> int:
        return self.site_of() if self.site_of is not None else -1

    # -- looking -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Block counts by state and the pool's counters (all processes)."""
        from kvscope.allocator.stats import pool_stats

        self._check_process()
        return pool_stats(self.view)

    def check(self) -> list:
        """Full consistency check; returns findings (empty when healthy)."""
        from kvscope.allocator.check import check_view
        from kvscope.allocator.integrity import check_kv
        from kvscope.allocator.snapshot import snapshot

        self._check_process()
        snap = snapshot(self.view)
        # The KV data too: published blocks' digests, freed blocks' poison, guard canaries.
        return check_view(snap) + check_kv(snap, self.kv, again=lambda: snapshot(self.view))

    def report(self, finding) -> None:
        """Record a finding in the segment's findings ring (and hand it to the probe callback)."""
        from kvscope.allocator.findings import write_finding

        fl = self.locks.index("findings")
        self._run({fl}, lambda t: write_finding(self.view, t, finding))
        if self.on_finding is not None:
            self.on_finding(finding)

    def findings(self) -> list:
        """Findings recorded in the segment by any process, oldest first."""
        from kvscope.allocator.findings import read_findings

        return read_findings(self.view)

    def verify(self) -> list:
        """Cheap per-step check (header magic, version, checksum; in guard mode every block's
        canary); findings, reported once."""
        self._check_process()
        if self.probe is None:
            from kvscope.allocator.probing import PoolProbes, ProbeFlags

            self.probe = PoolProbes(self, ProbeFlags(magic=True))
        return self.probe.verify()

    def block_state(self) -> torch.Tensor:
        """uint8 [num_blocks] on the pool's device, 1 where a block is ALLOCATED (for the
        kernels' guard-mode checks)."""
        from kvscope.allocator.layout import BlockState

        st = (self.view.blocks["state"] == BlockState.ALLOCATED).astype(np.uint8)
        return torch.from_numpy(st).to(self.kv.device)

    def dead_owners(self) -> list[dict[str, Any]]:
        """Processes that died while attached, with the blocks and sequences they left."""
        return dead_owners(self.view)

    def reclaim_dead(self, done: list[dict[str, Any]] | None = None) -> dict[str, int]:
        """Return dead processes' blocks to the pool; shared blocks lose only their references.

        Safe while other processes reclaim too. `done`, when given, gets one entry per process
        this call acted on (recovery.reclaim_dead)."""
        self._check_process()
        with self._mutex:
            self._busy[0] += 1
            try:
                return reclaim_dead(self, done)
            finally:
                self._busy[0] -= 1
