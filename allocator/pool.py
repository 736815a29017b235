"""KVPool: the shared paged KV pool, a binding of the C core (native.py, csrc/). Every public
operation is a method here that makes one call into the core, which does the work on the
segment: allocate, append, mark_computed, fork, free, abort, set_state, resume, evict (csrc/);
create, attach, unlink and reclaim_dead are lifecycle.py's (close in part), whose writes past the
client record are the core's too (csrc/recovery.c). The looking methods read the segment."""

from __future__ import annotations

import atexit
import json
import os
import threading
import weakref
from array import array
from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from typing import Any

import numpy as np
import torch

from kvscope.allocator import lifecycle, native
from kvscope.allocator.audit import check_table, host_array
from kvscope.allocator.check import check_view
from kvscope.allocator.config import KVEventsConfig, PoolConfig
from kvscope.allocator.errors import HandleInherited, PoolError
from kvscope.allocator.findings import (
    ERROR,
    REPAIRABLE_KINDS,
    Finding,
    FindingKind,
    read_findings,
    repaired_findings,
)
from kvscope.allocator.header import config_from_header
from kvscope.allocator.integrity import check_kv
from kvscope.allocator.layout import COUNTER_FIELDS, BlockState, SegmentView, SeqState, field_text
from kvscope.allocator.lease import DEFAULT_TIMEOUT_S, Lease, lease_rows
from kvscope.allocator.locks import LockTable
from kvscope.allocator.oplog import (
    RECORD_KEY_ENV,
    RECORD_LIMIT_ENV,
    RECORD_OPS_ENV,
    pool_tag,
    start_text,
)
from kvscope.allocator.probeflags import (
    ProbeFlags,
    guard_sample_from_env,
    provenance_sample_from_env,
)
from kvscope.allocator.probing import NATIVE_LOCKDEP, PoolProbes, ring_findings
from kvscope.allocator.process import my_identity
from kvscope.allocator.recovery import dead_owners
from kvscope.allocator.segment import release
from kvscope.allocator.sequence import Sequence
from kvscope.allocator.sites import caller_stack
from kvscope.allocator.snapshot import snapshot
from kvscope.allocator.stats import pool_stats

# Copy-on-write pairs kept owed until the program says it copied them (KVPool._copies_owed).
COPIES_PENDING = 4096
# The C core's end() takes the final state as a plain int.
_FINISHED, _ABORTED = int(SeqState.FINISHED), int(SeqState.ABORTED)
# (the state as a plain int: numpy compares an IntEnum member at twice the cost)
_ALLOCATED = int(BlockState.ALLOCATED)
# The kinds of finding a repair answers, as the core's mark_repaired takes them.
_REPAIRABLE = tuple(k.value for k in REPAIRABLE_KINDS)

# What `allocate` and `append` take as tokens: the C core reads each kind itself
# (csrc/tokens.c).
Tokens = Sequence_[int] | np.ndarray | torch.Tensor


# This process's pid, refreshed in a forked child (os.getpid() is a system call per operation).
_PID = [os.getpid()]


# Handles recording operations: what their cores hold still is written at exit (docs/REPLAY.md).
_RECORDING: weakref.WeakSet[KVPool] = weakref.WeakSet()


@atexit.register
def _flush_recordings() -> None:
    for pool in list(_RECORDING):
        if not pool.closed and pool.pid == os.getpid():
            pool.flush_recording()


def _env_key() -> int:
    """KVSCOPE_RECORD_OPS_KEY: the redaction key of a recording (0: none, or not a number)."""
    try:
        return int(os.environ.get(RECORD_KEY_ENV) or "0", 0) & (2**64 - 1)
    except ValueError:
        return 0


def _env_limit() -> int:
    """KVSCOPE_RECORD_OPS_LIMIT: a bounded log's limit in bytes (0: unbounded, or not a size)."""
    from kvscope.allocator.checkpoint import parse_size

    try:
        return parse_size(os.environ.get(RECORD_LIMIT_ENV) or "0")
    except ValueError:
        return 0


os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))


# Harness hooks, set by `kvscope run`'s bootstrap: each OPEN_HOOKS entry is called with every
# pool this process creates or attaches; CLOSE_HOOK, when set, with a pool about to be closed
# (its sequences still readable); UNLINK_HOOK, when set, is called instead of unlinking (the
# supervisor unlinks after it has dumped and analyzed the pool).
OPEN_HOOKS: list[Callable[[KVPool], None]] = []
CLOSE_HOOK: Callable[[KVPool], None] | None = None
UNLINK_HOOK: Callable[[KVPool], None] | None = None


class KVPool:
    """A paged KV-cache pool in shared memory, usable by many processes at once."""

    def __init__(
        self, name: str, mf, view: SegmentView, kv: torch.Tensor, created: bool, client: int = -1
    ):
        self.name = name
        self._mf = mf
        self.view = view
        self.kv = kv
        self.created = created
        # set (to 1) by a CUDA pool's checks where too many answers wait (devicechecks.MAX_PENDING)
        self._overdue = array("q", [0])
        self.config = config_from_header(view.h)
        self.block_size = self.config.block_size
        self.slots_per_block = self.config.slots_per_block
        self.pid, self.start = my_identity()
        # One operation at a time per mapping (handles of one process on one pool share it and
        # its one open of the segment, whose OFD locks do not exclude each other).
        # Sampled guard mode (guard_sample): one allocation in N guarded, drawn by the core at
        # each allocate and resume; the slots of the sequences it guards (their releases guard,
        # poison and quarantine; others do not) are the core's (`_core.guarded`).
        self._guard_every = guard_sample_from_env()
        self._prov_every = provenance_sample_from_env()
        # The light probes the C core runs itself for this handle (PoolProbes.native_bits).
        self._probe_bits = array("q", [0])
        # Ring positions of the findings the C core wrote in its last call (deliver_findings).
        self._found: list[int] = []
        # One operation at a time per mapping (handles of one process on one pool share it and
        # its one open of the segment, whose OFD locks do not exclude each other): the core
        # takes it while an operation waits for a pool lock (csrc/locks.c). Public: whatever
        # calls the core outside an operation of its own holds it too (the probes' modules,
        # lifecycle.py, probes/otel.py).
        self.op_mutex: threading.RLock = mf.__dict__.setdefault("op_mutex", threading.RLock())
        self._closed = False
        # The core's queue of K/V checks whose answers come later (a CUDA pool's, with guard
        # mode or the digest: devicechecks.DeviceChecks), settled before each allocation and
        # release; None (one attribute test) where the core checks the bytes itself.
        self._later: Any = None
        # The KV-event publisher of PoolConfig.kv_events (lifecycle.py), or None.
        self.kv_events: Any = None
        self._uid = id(self)
        # Probe hook: None when off (one attribute check per operation).
        self.on_finding: Callable[[Any], None] | None = None
        # A CUDA pool's block-table audits in flight (allocator/audit.py), made at the first.
        self._audits: Any = None
        # (at_close: what probes holding per-handle state let go as the handle closes)
        self._at_close: list[Callable[[KVPool], None]] = []
        # Dead processes an attach to a full client table reclaimed (lifecycle.py).
        self.reclaimed_at_attach: list[dict[str, Any]] = []
        # (binds this handle to its client record: _bind; `client`: a restored one's, taken over)
        lifecycle.register_client(self, mf, self._bind, client)
        # Under the probes, the copy-on-write pairs `append` handed out and the program has not
        # yet said it copied (`copied`), by destination: a copy told into any other block is
        # found at the copy (_check_copies). Its oldest dropped past COPIES_PENDING (a program
        # that copies without telling the pool).
        self._cow_pending: dict[int, int] = {}
        flags = ProbeFlags.from_env(int(view.h["flags"]))
        self.probe = PoolProbes(self, flags) if flags.any() else None
        for hook in OPEN_HOOKS:
            hook(self)
        # `kvscope run --record-ops FILE`: every handle of the run records (docs/REPLAY.md).
        self._recording = ""
        self._ring: Any = None
        # where this handle last stopped recording: the file's identity and the core's count of
        # its operations then (record_ops: operations no record holds)
        self._stopped: tuple[tuple[int, int] | None, int] | None = None
        if os.environ.get(RECORD_OPS_ENV):
            self.record_ops(os.environ[RECORD_OPS_ENV], _env_key(), _env_limit())

    # -- probe hooks -------------------------------------------------------------------------

    @property
    def probe(self) -> PoolProbes | None:
        """The probes watching this handle's operations (None when off)."""
        return self._probe

    @probe.setter
    def probe(self, value: PoolProbes | None) -> None:
        self._probe = value
        self._later = None if value is None else value.later
        # The C core runs every probe itself, from this word (lockdep's bit is lockdep's).
        bits = 0 if value is None else value.native_bits()
        self._probe_bits[0] = bits | (self._probe_bits[0] & NATIVE_LOCKDEP)

    def trace_locks(self, on: bool) -> None:
        """Have the C core trace this handle's locks for lockdep, or stop (lockdep's bit of
        its probe word: probes/lockdep.py)."""
        if on:
            self._probe_bits[0] |= NATIVE_LOCKDEP
        else:
            self._probe_bits[0] &= ~NATIVE_LOCKDEP

    @property
    def core(self) -> Any:
        """This handle's C core (native.Native). The probes' modules (probing.py,
        devicechecks.py, probes/lockgraph.py) and lifecycle.py call it
        for what is theirs: a call outside an operation holds `op_mutex`, and hands what the
        core reported to `deliver_findings`."""
        return self._core

    @property
    def closed(self) -> bool:
        """True once `close` detached this handle."""
        return self._closed

    @property
    def guard_sample(self) -> int:
        """Guard mode guards one allocation in this many (0 or 1: every one)."""
        return self._guard_every

    @guard_sample.setter
    def guard_sample(self, every: int) -> None:
        self._guard_every = every
        self._core.guard_sample(every)
        self.probe = self.probe  # the C core's share of the probes changes with it

    @property
    def provenance_sample(self) -> int:
        """Slot provenance records the slots of one sequence in this many (0: off, and no
        check at prefix hits); KVSCOPE_PROVENANCE_SAMPLE sets it at open (docs/POOL.md "Slot
        provenance")."""
        return self._prov_every

    @provenance_sample.setter
    def provenance_sample(self, every: int) -> None:
        self._core.provenance(int(every))
        self._prov_every = int(every)

    # -- lifecycle (lifecycle.py) -------------------------------------------------------------

    @classmethod
    def create(cls, name: str, config: PoolConfig) -> KVPool:
        """Create a new pool named `name`; PoolError if one exists or it cannot fit."""
        return lifecycle.create(cls, name, config)

    @classmethod
    def attach(
        cls,
        name: str,
        trust_owner: bool = False,
        kv_events: str | KVEventsConfig = "",
        client: int = -1,
    ) -> KVPool:
        """Attach to an existing pool by name (another user's only with `trust_owner`); with
        `kv_events`, publish its prefix index there until `close` (PoolConfig.kv_events); with
        `client`, take over that client record of a restored pool (`restore`: a replay's)."""
        return lifecycle.attach(cls, name, trust_owner, kv_events, client)

    @classmethod
    def restore(cls, name: str, config: PoolConfig, snapshot: Any) -> KVPool:
        """A new pool named `name` whose metadata is a snapshot's (allocator/checkpoint.py
        Snapshot, from an operation log: a replay's start), its K/V bytes fresh; the handle
        takes over the client record of the snapshot's writer, and `attach(name, client=c)`
        each other one the snapshot shows attached. `adopt_restored` then gives each handle its
        live sequences and leases."""
        return lifecycle.create(cls, name, config, restore=snapshot)

    def adopt_restored(
        self, reserve: tuple[list[int], int, int] | None = None
    ) -> tuple[list[Sequence], list[Lease]]:
        """A restored pool's (`restore`) live sequences and held leases of this handle's client
        record, made this handle's (the core registers the sequences), and its slot reserve:
        `reserve` (slots, next_id, end_id: the snapshot writer's, which its core held), else the
        slots the table marks reserved by it, with no sequence ids (the next claim takes a
        batch: `adopt_ids`)."""
        from kvscope.allocator import checkpoint

        self._check_process()
        seqs = checkpoint.sequences(self.view, self.client, self.block_size)
        with self.op_mutex:
            for s in seqs:
                self._core.adopt(s)
            if reserve is None:
                reserve = (checkpoint.reserved_slots(self.view, self.client), 0, 0)
            self._core.adopt_reserve(*reserve)
        leases = []
        for row in checkpoint.leases(self.view, self.client):
            leases.append(Lease(self, *row))
        return seqs, leases

    def adopt_ids(self, next_id: int, end_id: int) -> None:
        """A restored pool's handle (adopt_restored without a reserve) takes the sequence ids
        [next_id, end_id) as its own, with its reserved slots: ids its process's core held
        (a replay learns them from the process's first new sequence after the snapshot)."""
        self._check_process()
        with self.op_mutex:
            slots = list(self._core.reserve_state()[0])
            self._core.adopt_reserve(slots, next_id, end_id)

    def _bind(self, client: int) -> None:
        """Bind this handle's parts that name its client record: its counters, lock table and
        C core (lifecycle.register_client; an attach to a full client table binds a dead
        process's record first, to reclaim it)."""
        view = self.view
        self.client = client
        self.counters = {f: view.clients[f][client : client + 1] for f in COUNTER_FIELDS}
        self.locks = LockTable(self._mf, view, self.pid, self.start, client)
        n_shards = view.layout.num_shards
        self.SEQS = self.locks.index("seqs")
        self.SHARDS = [self.locks.index(f"index.{i}") for i in range(n_shards)]
        self.FREE = self.locks.index("free")
        # The C core (native.py): before the probes, which configure their checks in it
        # (devicechecks.py). It shares the handle's op mutex and these words with it.
        shared = {
            "found": self._found,
            "uid": self._uid,
            "mutex": self.op_mutex,
            "overdue": self._overdue,
            "probe_bits": self._probe_bits,
        }
        self._core = native.core_for(self, self._mf, shared)
        # slot provenance: one sequence in N recorded (KVSCOPE_PROVENANCE_SAMPLE; 0: off)
        self._core.provenance(provenance_sample_from_env())
        self._core.guard_sample(self._guard_every)

    def close(self) -> None:
        """Detach: report the sequences still live (each holding blocks a `leak_finished`
        finding: nothing can end them once the handle is gone), return this process's local
        cache and slot reserve, release the mapping."""
        if self._closed:
            return
        self._check_process()
        if self._audits is not None:
            # (a CUDA pool's block-table audits whose answers are still on their way)
            self._audits.settle(wait=True)
        lifecycle.before_close(self, CLOSE_HOOK)
        callbacks, self._at_close = self._at_close, []
        for fn in callbacks:
            fn(self)
        with self.op_mutex:
            # The core's: the live sequences reported as leaks, an interrupted operation's
            # journal rolled back, the local cache and the slot reserve returned, the counters
            # folded into the header, the record detached.
            self._core.detach(self)
            self._closed = True
        try:
            # (what the close found: the sequences and leases it still held, leak_finished and
            # lease_leak)
            self.deliver_findings()
        finally:
            self._core.close()
            self.view = None  # type: ignore[assignment]
            release(self._mf)

    def at_close(self, fn: Callable[[KVPool], None]) -> None:
        """Have `fn(pool)` called as this handle closes, before the core detaches it: where a
        probe that keeps state about the handle (lockdep's graph of its segment) lets it go, so
        a closed handle is not kept alive by it."""
        self._at_close.append(fn)

    def flush_local(self) -> None:
        """Return this process's local cache of free blocks to the free ring (the core's
        transaction), where the pool's other processes allocate them."""
        self._check_process()
        with self.op_mutex:
            self._core.flush_local()

    def unlink(self) -> None:
        """Remove the pool's files; processes still attached keep their mappings until they close."""
        lifecycle.unlink(self, UNLINK_HOOK)

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reclaim_dead(self, done: list[dict[str, Any]] | None = None) -> dict[str, int]:
        """Return dead processes' blocks to the pool; shared blocks lose only their references.

        Safe while other processes reclaim too. `done`, when given, gets one entry per process
        this call acted on (lifecycle.reclaim_dead)."""
        self._check_process()
        return lifecycle.reclaim_dead(self, done)

    def reclaim_orphans(self) -> list[dict[str, Any]]:
        """End the live sequences no handle holds: a process closed its handle (or detached)
        without ending them, which its close reported as `leak_finished`; their blocks go back
        to the pool, shared ones losing only their references (the core's transactions, under
        every lock: safe while other processes run and reclaim). One entry per sequence ended:
        `pid`, `client` (its record), `request`, `blocks` (returned to the pool)."""
        self._check_process()
        with self.op_mutex:
            return self._core.reclaim_orphans()

    def clear_repaired(self, pids: set[int]) -> list:
        """After a repair returned what the dead processes `pids` held: mark the recorded
        findings about their leaks and the locks they died holding as repaired (the core's
        transaction), so that a repaired pool reads healthy (readers leave them out:
        allocator/findingset.py); the findings marked (`kvscope check --repair`)."""
        if not pids:
            return []
        self._check_process()
        with self.op_mutex:
            marked = self._core.mark_repaired(pids, _REPAIRABLE)
        return repaired_findings(self.view, marked)

    def repair_leases(self) -> dict[str, Any]:
        """Make the lease section agree with itself (`kvscope check --repair`, after
        `reclaim_dead`): the leases whose holder's client record is detached or another
        process's (nothing else ends them) ended, each block's lease count set to the held
        leases naming it, the header's counts set to the records' (the core's transactions,
        csrc/recovery.c). What it did: `ended` (lease ids), `counts` (blocks recounted),
        `header` (the header fields rewritten)."""
        self._check_process()
        with self.op_mutex:
            return self._core.repair_leases()

    def _check_process(self, verify: bool = True) -> None:
        if self._closed:
            raise PoolError(f"pool {self.name!r} is closed")
        if _PID[0] != self.pid:
            raise HandleInherited(self.name, self.pid)
        # (after the checks above: the verification runs operations of its own)
        if verify and self.probe is not None and self.probe.flags.magic:
            self.probe.verify_often()

    def record_ops(self, path: str, redact_key: int = 0, limit: int = 0) -> None:
        """Record every operation of this handle into the operation log at `path` (appended
        to; docs/REPLAY.md), from a START record on; with `redact_key` (a non-zero integer),
        token ids and request ids as keyed hashes. Until `close` or `stop_recording`.

        Where the pool has a history the log does not hold (this handle attached, or operations
        ran before, and the file holds no START of the pool's creation), a SNAPSHOT of the pool
        follows the START, to replay from (allocator/checkpoint.py; not with `redact_key`: the
        snapshot would hold the tokens and request ids). With `limit` (bytes, > 0), the log is
        bounded: past the limit a checkpoint is written and what came before the one before it
        dropped (docs/REPLAY.md "A bounded log")."""
        self._check_process()
        path = os.fspath(path)
        if path == self._recording:
            return
        from kvscope.allocator import checkpoint

        if limit > 0 and redact_key:
            raise PoolError(
                "a bounded operation log is not redacted: its checkpoints hold the pool's "
                "tokens and request ids"
            )
        tag = pool_tag(self.name, int(self.view.h["created_ns"]))
        # This handle's operations that no record in the file holds: any it ran before it began
        # recording, or since it last stopped recording into this file (operations unrecorded
        # take no number, so the file shows no gap): the records before this START do not lead
        # to the pool after it, and a snapshot follows, which a replay starts from.
        ops = int(self._core.stats()["native_ops"])
        if self._recording:
            self._stopped = (_file_id(self._recording), ops)
        unrecorded = ops != 0 and self._stopped != (_file_id(path), ops)
        # (before the START: whether the file holds the pool's creation already)
        history = unrecorded or checkpoint.has_history(self, path, tag)
        text = start_text(
            self.name,
            self.created,
            self.config,
            None if self.probe is None else self.probe.flags,
            bool(self._probe_bits[0] & NATIVE_LOCKDEP),
            self._guard_every,
            int(self.view.h["op_seq"]),
            bool(redact_key),
            self._prov_every,
            history,
            unrecorded,
        )
        off = self.view.header.dtype.fields["op_seq"][1]
        with self.op_mutex:
            self._core.oplog_open(path, redact_key, text, off, tag)
        self._recording = path
        _RECORDING.add(self)
        start = json.loads(text)
        if history and not redact_key:
            checkpoint.write(self, start)
        if limit > 0 and not redact_key:
            self._ring = checkpoint.Ring(self, path, int(limit), start)
            with self.op_mutex:
                self._core.oplog_ring(int(limit), self._ring, self._ring.base())

    @property
    def recording(self) -> str:
        """The operation log this handle records into ("": none; record_ops)."""
        return self._recording

    @property
    def checkpoints(self) -> int:
        """The checkpoints this handle wrote into its bounded log (record_ops(limit=)) since it
        began recording into it (0 for an unbounded one)."""
        return 0 if self._ring is None else int(self._ring.checkpoints)

    def flush_recording(self) -> None:
        """Write the records this handle's core holds still (record_ops) into the log now."""
        self._check_process()
        with self.op_mutex:
            self._core.oplog_flush()

    def stop_recording(self) -> None:
        """Stop recording operations (record_ops)."""
        self._check_process()
        if self._recording:
            self._stopped = (_file_id(self._recording), int(self._core.stats()["native_ops"]))
        with self.op_mutex:
            self._core.oplog_close()
        self._recording = ""
        self._ring = None

    def live(self) -> dict[int, Sequence]:
        """This handle's live sequences by slot, in the order they were entered (a copy of the
        C core's registry)."""
        return self._core.live()

    def _own(self, seq: Sequence) -> None:
        """PoolError unless seq is a live sequence of this handle."""
        self._check_process()
        if not isinstance(seq, Sequence):
            raise PoolError(f"expected a Sequence, got {type(seq).__name__}")
        if seq.pool_uid != self._uid:
            raise PoolError(
                f"sequence {seq.request_id!r} belongs to another pool handle, not to pool {self.name!r}"
            )
        if seq.slot < 0:
            raise PoolError(f"sequence {seq.request_id!r} was already {seq.state}")

    # -- sequences (each a call into the C core) -------------------------------------------------

    # Each of these is one call into the core, which does what comes before the operation
    # too (csrc/entry.c E_*): the slot reserve refilled when empty or trimmed when full (in a
    # transaction of its own under the seqs lock, so that the operation itself needs neither),
    # sampled guard mode's draw at a claim, guard mode's check of a finished request's K/V at a
    # free. Around it: a CUDA pool's check answers settled first (`_later`), and what the core
    # reported handed to `on_finding` after (`_found`).

    def allocate(self, request_id: object, tokens: Tokens) -> Sequence:
        """Reserve blocks for a prompt, reusing cached prefix blocks; returns its Sequence.

        `tokens`: any sequence of ints, or a one-dimensional numpy or torch integer array;
        `request_id`: any object, kept as its str() (docs/POOL.md)."""
        if self._later is not None:
            self._later.settle()
        # (the core allocates a prompt of any length: its hits and first CHUNK new blocks in one
        # transaction, the rest appended, a transaction per CHUNK blocks' worth)
        seq = self._core.allocate(self, tokens, request_id)
        if self._found:
            self.deliver_findings()
        return seq

    def append(self, seq: Sequence, tokens: Tokens) -> list[tuple[int, int]]:
        """Append tokens (as `allocate` takes them); returns a list of the copy-on-write (src,
        dst) block pairs to copy first (empty when there is none)."""
        try:
            done = self._core.append(self, seq, tokens)
        finally:
            # (a refused call's finding too: a use_after_free of a sequence already ended)
            if self._found:
                self.deliver_findings()
        if done and self._probe is not None:
            self._copies_owed(done)
        # (the overdue word is only ever set where there is a queue: `_later` tested first,
        # the cheaper test)
        if self._later is not None and self._overdue[0]:
            self._settle_overdue()
        return done

    def copied(self, src: Any, dst: Any) -> None:
        """The program copied block src[i] to dst[i] (whole, every layer, K and V): the
        copy-on-write pairs `append` returned, once performed (`kvscope.kernels.copy_blocks(...,
        pool=pool)` says so). While the handle records (docs/REPLAY.md), a COPY record of the
        pairs, so that a replay copies its K/V where the program did, and a copy the program
        skipped is missing there too; not recording, one attribute test. `src`, `dst`: lists,
        numpy arrays or tensors of block ids (a CUDA tensor is read back while recording: pass
        the pairs on the host, as `append` returns them)."""
        probe = self._probe
        if not self._recording and probe is None:
            return
        if not self._recording and any(
            isinstance(x, torch.Tensor) and x.is_cuda for x in (src, dst)
        ):
            return  # (not read back to check: a CUDA step waits for no copy of its own)
        if isinstance(src, torch.Tensor):
            src = src.detach().cpu().numpy()
        if isinstance(dst, torch.Tensor):
            dst = dst.detach().cpu().numpy()
        a = np.asarray(src, dtype=np.int64).reshape(-1)
        b = np.asarray(dst, dtype=np.int64).reshape(-1)
        if a.shape != b.shape:
            raise PoolError(f"copied: {a.size} source block(s) but {b.size} destination(s)")
        if a.size == 0:
            return
        self._check_process()
        if self._recording:
            pairs = np.ascontiguousarray(np.stack([a, b], axis=1))
            with self.op_mutex:
                self._core.oplog_copy(pairs)
        if probe is not None:
            # (after its COPY record: what it finds is the REPORTs that follow it, as a
            # store check's, which a replay's COPY finds again)
            self._check_copies(probe, a, b)

    def _copies_owed(self, pairs: list[tuple[int, int]]) -> None:
        """The copy-on-write pairs an append handed out, owed until `copied` is told them."""
        owed = self._cow_pending
        for src, dst in pairs:
            owed[dst] = src
        while len(owed) > COPIES_PENDING:
            del owed[next(iter(owed))]

    def _check_copies(self, probe: PoolProbes, src: np.ndarray, dst: np.ndarray) -> None:
        """Under the probes, each copy told must be a pair `append` handed out: a copy into
        another block (one made the wrong way round, into the shared source a sibling still
        reads; a destination worked out by hand) overwrites K/V its holders read:
        `published_block_modified` (a published block) or `unmapped_write`, naming the copy's
        line, found at the copy. Nothing is said while no pair is owed (a program that makes
        no copy-on-write copy, or has told every one), nor of a pair never told (copies made
        without telling)."""
        owed = self._cow_pending
        blocks = self.view.blocks
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            if owed.pop(d, None) is not None or not owed or not 0 <= d < len(blocks):
                continue
            rec = blocks[d]
            indexed = bool(rec["indexed"])
            held = (
                "published in the prefix index"
                if indexed
                else f"held by request {field_text(rec['request'])!r}, refcount {int(rec['refcount'])}"
            )
            probe.report(
                Finding(
                    FindingKind.PUBLISHED_BLOCK_MODIFIED if indexed else FindingKind.UNMAPPED_WRITE,
                    f"a copy of block {s} into block {d} at {caller_stack(1)}: block {d} is"
                    f" no copy-on-write destination append handed out ({held})",
                    block=d,
                    owner_pid=int(rec["owner_pid"]) or None,
                    request=field_text(rec["request"]) or None,
                )
            )

    def mark_computed(self, seq: Sequence, num_tokens: int) -> int:
        """Publish the full blocks of positions [0, num_tokens) in the prefix index; return how many."""
        # (the core's: a transaction per CHUNK blocks, the undo journal's bound)
        try:
            done = self._core.mark_computed(self, seq, num_tokens)
        finally:
            if self._found:
                self.deliver_findings()
        # (the overdue word is only ever set where there is a queue: `_later` tested first,
        # the cheaper test)
        if self._later is not None and self._overdue[0]:
            self._settle_overdue()
        return done

    def mark_computed_many(
        self, seqs: Sequence_[Sequence], num_tokens: Sequence_[int]
    ) -> list[int]:
        """`mark_computed(seqs[i], num_tokens[i])` for each i in turn, in one call of the core:
        a step's publications, whose checks of a CUDA pool's K/V are one launch; how many
        blocks each published. At the first that raises, the call raises it: those before it
        stay published, the rest are not (docs/POOL.md)."""
        if not isinstance(seqs, (list, tuple)):
            seqs = list(seqs)
        if not isinstance(num_tokens, (list, tuple)):
            num_tokens = list(num_tokens)
        try:
            done = self._core.mark_computed_many(self, seqs, num_tokens)
        finally:
            # (what the sequences published before an error reported reaches on_finding too)
            if self._found:
                self.deliver_findings()
        if self._later is not None and self._overdue[0]:
            self._settle_overdue()
        return done

    def _settle_overdue(self) -> None:
        """The answers of a CUDA pool's checks, where more have piled up than devicechecks
        keeps (a program that publishes and appends but never allocates or frees)."""
        self._overdue[0] = 0
        if self._later is not None:
            self._later.settle_overdue()

    def fork(self, seq: Sequence, request_id: object) -> Sequence:
        """A new sequence sharing every block of seq (refcounts +1); `request_id` as in
        `allocate`."""
        try:
            child = self._core.fork(self, seq, request_id)
        finally:
            if self._found:
                self.deliver_findings()
        return child

    def free(self, seq: Sequence) -> None:
        """Release a finished sequence: shared blocks lose a reference, published ones stay cached.
        In guard mode (of a sampled request, sampled), its K/V slots still poisoned are
        `kv_never_written` (checked by the core's release)."""
        self._end(seq, _FINISHED)

    def abort(self, seq: Sequence) -> None:
        """Release a sequence whose request did not finish."""
        self._end(seq, _ABORTED)

    def _end(self, seq: Sequence, final: int) -> None:
        """free or abort: the core's release. What the core reported reaches `on_finding` even
        where it refuses the release (a second free's double_free)."""
        if self._later is not None:
            self._later.settle()
        try:
            self._core.end(self, seq, final)
        finally:
            if self._found:
                self.deliver_findings()

    def set_state(self, seq: Sequence, state: str) -> None:
        """Mark a sequence running or waiting (only waiting ones may be preempted)."""
        try:
            self._core.set_state(self, seq, state)
        finally:
            if self._found:
                self.deliver_findings()

    def resume(self, seq: Sequence) -> int:
        """Re-reserve blocks for a preempted sequence's tokens; returns its cached-token count."""
        if self._later is not None:
            self._later.settle()
        try:
            cached = self._core.resume(self, seq)
        finally:
            if self._found:
                self.deliver_findings()
        return cached

    def evict(self, num_blocks: int) -> int:
        """Evict up to num_blocks CACHED blocks (LRU first) to the free ring; return how many."""
        self._check_process()
        with self.op_mutex:
            done = self._core.evict(self, num_blocks)
        if self._found:
            self.deliver_findings()
        return done

    def audit_block_table(
        self,
        table: Any,
        rows: Sequence_[Sequence] = (),
        lengths: Any = None,
        padding: int = -1,
        wait: bool = False,
    ) -> list:
        """Check the block table a kernel will read, the whole buffer: row i of `table` ([R, W]
        ints) is `rows[i]`'s (live sequences of this handle), whose first ceil(lengths[i] /
        block_size) entries (`lengths`: the tokens the kernel reads per row; None: each
        sequence's tokens) must be its blocks in order, and every other entry (past a row's
        length, and every row past `rows`: padding rows) must equal `padding`, which is no
        block of the pool. What differs is one `block_table_mismatch` finding per audit, about
        the first bad entry, reported through the core. A host table is compared by the core
        in one call; a CUDA table by one kernel launch, its answer reported at the next audit
        (or now, with `wait`). The findings reported by this call."""
        self._check_process()
        rows = list(rows)
        if isinstance(table, torch.Tensor) and table.is_cuda:
            audits = self.device_audits()
            found = audits.settle()
            check_table(table)
            audits.launch(table, rows, host_array(lengths, "lengths"), padding)
            return found + (audits.settle(wait=True) if wait else [])
        before = len(self._found)
        with self.op_mutex:
            self._core.audit_table(
                self, host_array(table, "table"), rows, host_array(lengths, "lengths"), padding,
                None,
            )  # fmt: skip
        found = ring_findings(self.view, self._found[before:]) if self._found else []
        if self._found:
            self.deliver_findings()
        return found

    def table_audit(
        self, table: Any, padding: int = -1, expected: Any = None, answer: Any = None
    ) -> Any:
        """The audit of one static block table a CUDA graph reads, captured with it
        (`allocator.audit.TableAudit`): call `launch()` where the forward that reads `table` is
        captured, and `expect(rows, lengths)` before each replay (the audit of
        `audit_block_table`, the step paying no launch of its own; its answer reported at a
        later `expect`, `audit_block_table`, or `close`). With a table in host memory, `expect`
        is `audit_block_table` and `launch` does nothing (docs/POOL.md "The block-table
        audit"). `expected` ((page-locked host, device) int32 buffers of the table's shape)
        and `answer` (an int64 [4] device buffer): buffers of the caller's, which it moves
        with its own transfers (TableAudit's `replayed` and `answered`)."""
        self._check_process()
        from kvscope.allocator.audit import TableAudit

        return TableAudit(self, table, padding, expected, answer)

    def device_audits(self) -> Any:
        """This handle's CUDA block-table audits in flight (`allocator.audit.DeviceAudits`),
        made at the first."""
        if self._audits is None:
            from kvscope.allocator.audit import DeviceAudits

            self._audits = DeviceAudits(self)
        return self._audits

    def check_provenance(self, seqs: Sequence_[Sequence] | None = None) -> list:
        """The slot-provenance sweep: each slot that `seqs` (live sequences of this handle;
        None: all of them) read, whose provenance is recorded, must have been written for the
        token the block holds there at the position the sequence reads it as (its own token, or
        its prefix hit's). A slot written otherwise is a `foreign_slot` finding, once per block,
        reported through the core. The findings reported by this call (docs/POOL.md "Slot
        provenance")."""
        self._check_process()
        before = len(self._found)
        with self.op_mutex:
            self._core.provenance_check(self, None if seqs is None else list(seqs))
        found = ring_findings(self.view, self._found[before:]) if self._found else []
        if self._found:
            self.deliver_findings()
        return found

    # -- leases (csrc/leases.c) ------------------------------------------------------------------

    def lease(
        self,
        seq_or_blocks: Sequence | Sequence_[int],
        mode: str,
        holder: object = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        deadline_ns: int | None = None,
    ) -> Lease:
        """Lease blocks for a transfer in flight (mode "read" or "write"): until the returned
        Lease is released, a leased block that is freed or preempted is quarantined and never
        handed out, and eviction passes it over. `holder` (its str; default: this thread's
        name) names who transfers; `timeout` seconds (None: none) is its deadline for
        `expire_leases`, or `deadline_ns` the deadline itself on time.monotonic_ns()'s clock
        (a replay's: the recorded one). docs/POOL.md "Leases"."""
        who = threading.current_thread().name if holder is None else holder
        if timeout is None:
            ns = 0
        elif timeout > 0:
            ns = int(timeout * 1e9) or 1
        else:
            raise PoolError(f"lease timeout must be a positive number of seconds, got {timeout!r}")
        # (the blocks as the core leases them: a take's preemption, the transfer-after-free
        # fault's, empties the sequence's table after)
        target = seq_or_blocks
        if isinstance(target, Sequence):
            blocks = list(target.block_table)
        else:
            try:
                # (any iterable of block ids, read once: a generator is not read twice)
                target = list(target)
                blocks = [int(b) for b in target]
            except (TypeError, ValueError):
                blocks = []  # (not block ids: the core refuses it)
        if deadline_ns is not None and deadline_ns < 0:
            raise PoolError(f"lease deadline_ns must be >= 0, got {deadline_ns!r}")
        try:
            if deadline_ns is None:
                record, lease_id = self._core.lease(self, target, mode, who, ns)
            else:
                record, lease_id = self._core.lease(self, target, mode, who, ns, deadline_ns)
        finally:
            if self._found:
                self.deliver_findings()
        return Lease(
            self, record, lease_id, mode, who if type(who) is str else str(who), list(blocks)
        )

    def lease_release(self, lease: Lease) -> bool:
        """End a lease (what `Lease.release` calls): True when this call ended it. A write
        lease whose blocks changed owner or generation meanwhile is a transfer_after_free
        finding."""
        done = self._core.lease_release(self, lease.record, lease.lease_id)
        if self._found:
            self.deliver_findings()
        return bool(done)

    def expire_leases(self, now_ns: int | None = None) -> int:
        """Report every lease of the pool (any process's) whose deadline has passed as a
        lease_leak, once each; `now_ns` on time.monotonic_ns()'s clock (default: now). How many
        it reported."""
        found = self._core.lease_expire(self, -1 if now_ns is None else int(now_ns))
        if self._found:
            self.deliver_findings()
        return int(found)

    def leases(self) -> list[dict[str, Any]]:
        """The leases held in the pool (every process's), oldest first (lease.lease_rows)."""
        self._check_process()
        return lease_rows(self.view)

    def block_table(self, seq: Sequence) -> list[int]:
        """Physical block ids of seq, logical order."""
        self._own(seq)
        return list(seq.block_table)

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Flat KV slot (block * slots_per_block + offset) of each position in [start, end)."""
        self._own(seq)
        bs, spb, table = self.block_size, self.slots_per_block, seq.block_table
        return [table[p // bs] * spb + p % bs for p in range(start, end)]

    # -- looking -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Block counts by state and the pool's counters (all processes)."""
        self._check_process()
        return pool_stats(self.view)

    def check(self) -> list:
        """Full consistency check; returns findings (empty when healthy)."""
        self._check_process()
        if self.probe is not None:
            self.probe.settle(wait=True)
        snap = snapshot(self.view)
        # The KV data too: published blocks' digests, freed blocks' poison, guard canaries.
        return check_view(snap) + check_kv(snap, self.kv, again=lambda: snapshot(self.view))

    def report(self, finding) -> None:
        """Record a finding in the segment's findings ring (and hand it to the probe callback)."""
        self._check_process()
        self.record(finding)
        if self.on_finding is not None:
            self.on_finding(finding)

    def record(self, finding) -> None:
        """Write a finding into the segment's findings ring, as it is: the C core writes it,
        under the findings lock (taken there, waiting and recovering a dead holder, or held
        already by this thread: lockdep's graph, the watchdog)."""
        f = finding
        args = (
            f.kind,
            1 if f.severity == ERROR else 2,
            -1 if f.block is None else f.block,
            f.owner_pid or 0,
            f.site_id,
            f.request or "",
            f.message,
        )
        self._core.report(*args)

    def deliver_findings(self) -> None:
        """Hand what the C core reported in its last call to `on_finding`, read back from the
        findings ring as every reader reads it (the core writes findings, calls no Python).
        Internal, public for the modules that call `core` outside an operation of this class
        (lifecycle.py, the probes' modules): each calls it after its call."""
        if not self._found:
            return
        # Taken and deleted by count: what another thread's operation reports meanwhile
        # lands past it and is kept for that thread's own delivery.
        n = len(self._found)
        found = self._found[:n]
        del self._found[:n]
        if self.on_finding is not None:
            for f in ring_findings(self.view, found):
                self.on_finding(f)

    def findings(self) -> list:
        """Findings recorded in the segment by any process, oldest first."""
        return read_findings(self.view)

    def verify(self) -> list:
        """Cheap per-step check, at once: one call of the C core (the header's bytes and
        checksum against those seen at attach; with the leaks probe, block conservation), and
        in guard mode every block's canary; the findings reported in this call (each is
        reported once per handle)."""
        self._check_process(verify=False)  # (the core's check runs here, at once)
        if self.probe is None:
            self.probe = PoolProbes(self, ProbeFlags(magic=True))
        return self.probe.verify()

    def block_state(self, out: Any = None) -> Any:
        """uint8 [num_blocks] on the pool's device, 1 where a block is ALLOCATED (for the
        kernels' guard-mode checks); with `out` (a CPU uint8 tensor of that size, page-locked
        for an asynchronous copy, or a numpy uint8 view of one: what a caller asking at every
        step keeps), written there instead, with no upload."""
        if isinstance(out, np.ndarray):
            np.equal(self.view.blocks["state"], _ALLOCATED, out=out.view(bool))
            return out
        host = torch.empty(len(self.view.blocks), dtype=torch.uint8) if out is None else out
        np.equal(self.view.blocks["state"], _ALLOCATED, out=host.numpy().view(bool))
        if out is not None:
            return out
        from kvscope.kernels.backend import upload

        return upload(host, self.kv.device)

    def dead_owners(self) -> list[dict[str, Any]]:
        """Processes that died while attached, with the blocks and sequences they left."""
        return dead_owners(self.view)


def _file_id(path: str) -> tuple[int, int] | None:
    """A file's identity (device, inode; None: no file): a log recreated is another."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)
