"""The findings vocabulary shared by check(), every probe, `analyze --json` and the exporters."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class FindingKind(str, enum.Enum):
    """Finding kinds: the names `analyze --json` and every probe use (docs/PROBES.md)."""

    HEADER_CORRUPT = "header_corrupt"
    BLOCK_HEADER_CORRUPT = "block_header_corrupt"
    FREE_LIST_CORRUPT = "free_list_corrupt"
    DOUBLE_FREE = "double_free"
    REFCOUNT_MISMATCH = "refcount_mismatch"
    USE_AFTER_FREE = "use_after_free"
    OUT_OF_BOUNDS = "out_of_bounds"
    GUARD_VIOLATION = "guard_violation"
    # The K/V of a block published to the prefix index changed after it was published.
    PUBLISHED_BLOCK_MODIFIED = "published_block_modified"
    # A finished request's block still holds the poison where its tokens' K/V belongs.
    KV_NEVER_WRITTEN = "kv_never_written"
    # A store wrote K/V into a block the writing request does not map (probes/stores.py).
    UNMAPPED_WRITE = "unmapped_write"
    LEAK_DEAD_OWNER = "leak_dead_owner"
    LEAK_FINISHED = "leak_finished"
    LEAK_ORPHAN = "leak_orphan"
    LOCK_DEAD_HOLDER = "lock_dead_holder"
    LOCK_ORDER_CYCLE = "lock_order_cycle"
    LOCK_HELD_TOO_LONG = "lock_held_too_long"
    # A block table a kernel will read maps a block its row's sequence does not hold there, or
    # holds a block where the padding belongs (KVPool.audit_block_table).
    BLOCK_TABLE_MISMATCH = "block_table_mismatch"
    # A wait of the pool's C core that keeps the GIL (lockdep: a thread the lock's holder
    # needs cannot run).
    WAIT_HOLDS_GIL = "wait_holds_gil"
    # A write lease's transfer completed into a block its request no longer holds (freed,
    # preempted or handed out since the lease was taken: docs/POOL.md "Leases").
    TRANSFER_AFTER_FREE = "transfer_after_free"
    # A lease held past its deadline, or still held when its holder closed the pool.
    LEASE_LEAK = "lease_leak"
    # A slot a sequence reads (its own, or a prefix hit's) holds K/V its slot provenance says
    # another token or position wrote (docs/POOL.md "Slot provenance").
    FOREIGN_SLOT = "foreign_slot"
    # An engine's KV-event stream (kvscope events check, docs/EVENTS.md).
    KV_EVENT_GAP = "kv_event_gap"
    KV_EVENT_SEQ_RESET = "kv_event_seq_reset"
    KV_EVENT_REORDER = "kv_event_reorder"
    KV_EVENT_MALFORMED = "kv_event_malformed"
    KV_EVENT_REMOVE_UNSTORED = "kv_event_remove_unstored"
    KV_EVENT_STORE_CONFLICT = "kv_event_store_conflict"
    KV_EVENT_UNKNOWN_PARENT = "kv_event_unknown_parent"
    KV_EVENT_AFTER_CLEAR = "kv_event_after_clear"
    KV_EVENT_TOKEN_COUNT = "kv_event_token_count"
    KV_EVENT_PARTIAL_REAPPEARED = "kv_event_partial_reappeared"
    # More blocks stored at once than the engine's pool holds (events check --num-blocks).
    KV_EVENT_OVER_CAPACITY = "kv_event_over_capacity"
    # Two publishers' batches on one (endpoint, topic, rank): their seqs interleave.
    KV_EVENT_INTERLEAVED = "kv_event_interleaved"
    # kvscope's own published stream (events/publisher.py) against its pool's prefix index.
    KV_EVENT_INDEX_MISMATCH = "kv_event_index_mismatch"
    # A process that an operation on a handle its parent opened (inherited through fork) ended
    # (kvscope.child: its exit check).
    HANDLE_INHERITED = "handle_inherited"
    # A live request holding blocks that its process has not served for KVSCOPE_IDLE_REQUEST_S
    # seconds (allocator/idle.py): a leak in the making in a server that never exits.
    IDLE_REQUEST = "idle_request"


ERROR, WARNING = "error", "warning"

# Blocks held that nothing will give back.
LEAK_KINDS = frozenset(
    {
        FindingKind.LEAK_DEAD_OWNER,
        FindingKind.LEAK_FINISHED,
        FindingKind.LEAK_ORPHAN,
        FindingKind.LEASE_LEAK,
    }
)

SEVERITY: dict[FindingKind, str] = {k: ERROR for k in FindingKind}
SEVERITY.update(
    {
        FindingKind.LEAK_DEAD_OWNER: WARNING,
        FindingKind.LOCK_HELD_TOO_LONG: WARNING,
        FindingKind.LOCK_DEAD_HOLDER: WARNING,
        FindingKind.KV_EVENT_SEQ_RESET: WARNING,
        FindingKind.IDLE_REQUEST: WARNING,
    }
)


@dataclass
class Finding:
    """One problem, in the shape `analyze --json` prints."""

    kind: str
    message: str
    block: int | None = None
    owner_pid: int | None = None
    request: str | None = None
    severity: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    # The block's allocation site id as the finding saw it (-1: none); recorded with it, so a
    # report names it after the block is handed out again. Not part of the JSON.
    site_id: int = -1

    def __post_init__(self) -> None:
        kind = FindingKind(self.kind)
        self.kind = kind.value
        if not self.severity:
            self.severity = SEVERITY[kind]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with the keys of docs/CLI.md's report (plus `extra` when non-empty)."""
        d = asdict(self)
        d.pop("site_id")
        if not d["extra"]:
            d.pop("extra")
        return d

    def line(self) -> str:
        """One line for a terminal."""
        where = f" block {self.block}" if self.block is not None else ""
        who = f" pid {self.owner_pid}" if self.owner_pid else ""
        req = f" request {self.request!r}" if self.request else ""
        return f"{self.severity}: {self.kind}{where}{who}{req}: {self.message}"


def read_findings(view) -> list[Finding]:
    """Findings in the segment's ring, oldest first (a repaired one with `extra["repaired"]`)."""
    from kvscope.allocator.layout import FINDINGS_CAPACITY

    head = int(view.h["findings_head"])
    return [finding_at(view, k) for k in range(max(0, head - FINDINGS_CAPACITY), head)]


def finding_at(view, k: int) -> Finding:
    """The finding at position k of the ring (its k-th since the pool was created)."""
    from kvscope.allocator.layout import FINDINGS_CAPACITY

    r = view.findings[k % FINDINGS_CAPACITY]
    block = int(r["block"])
    return Finding(
        kind=bytes(r["kind"]).decode(),
        message=bytes(r["message"]).decode(errors="replace"),
        block=None if block < 0 else block,
        owner_pid=int(r["owner_pid"]) or None,
        request=bytes(r["request"]).decode(errors="replace") or None,
        severity=ERROR if int(r["severity"]) == 1 else WARNING,
        extra={"time_ns": int(r["time_ns"])} | ({"repaired": True} if r["repaired"] else {}),
        site_id=int(r["site"]) - 1,
    )


def readable_findings(view) -> list[Finding]:
    """`read_findings`, or nothing when the ring is scribbled over (a record of no known kind):
    what every reader of a possibly hostile segment calls."""
    try:
        return read_findings(view)
    except ValueError:
        return []


# What a repair answers about a dead process: its leaks and the locks it died holding.
REPAIRABLE_KINDS = LEAK_KINDS | {FindingKind.LOCK_DEAD_HOLDER}


def repaired_findings(view, positions: list[int]) -> list[Finding]:
    """The findings at these ring positions, as a repair reports those it marked repaired
    (the core marks them: csrc/recovery.c mark_repaired)."""
    from kvscope.allocator.layout import FINDINGS_CAPACITY

    out = []
    for k in positions:
        r = view.findings[k % FINDINGS_CAPACITY]
        block = int(r["block"])
        out.append(
            Finding(
                kind=bytes(r["kind"]).decode(errors="replace"),
                message=bytes(r["message"]).decode(errors="replace"),
                block=None if block < 0 else block,
                owner_pid=int(r["owner_pid"]),
                request=bytes(r["request"]).decode(errors="replace") or None,
            )
        )
    return out
