"""Leases: a transfer in flight over a pool's blocks (docs/POOL.md "Leases").

`KVPool.lease` takes one in the C core (csrc/leases.c) and returns a `Lease`, which the
transfer releases when it completes: `lease.release()`, a `with` or `async with` block, or
`lease.release_when(future)`. The lease table lives in the segment (FORMAT.md section 13);
`lease_rows` and `lease_totals` read it for every reader (analyze, top, report, timeline).
"""

from __future__ import annotations

from typing import Any, Protocol

from kvscope.allocator.layout import LeaseMode, LeaseState, SegmentView, field_text

# A lease's deadline when `KVPool.lease` is given none: held longer, it is a lease_leak at the
# next `expire_leases`.
DEFAULT_TIMEOUT_S = 60.0


class LeaseOwner(Protocol):
    """What a Lease needs of its pool (KVPool): the release, one call into the core."""

    def lease_release(self, lease: Lease) -> bool: ...


class Lease:
    """One lease: `release()` once its transfer completes (idempotent)."""

    __slots__ = ("pool", "record", "lease_id", "mode", "holder", "blocks", "_done")

    def __init__(
        self,
        pool: LeaseOwner,
        record: int,
        lease_id: int,
        mode: str,
        holder: str,
        blocks: list[int],
    ):
        self.pool = pool
        self.record = record
        self.lease_id = lease_id
        self.mode = mode
        self.holder = holder
        self.blocks = blocks
        self._done: bool | None = None

    @property
    def released(self) -> bool:
        """True once `release()` ran."""
        return self._done is not None

    def release(self) -> bool:
        """The transfer completed: end the lease (the core's call, which any thread may make).
        True when this call ended it, False when it was no longer held (released already, or
        ended by its holder's close or a reclaim); a later call returns the first one's
        answer."""
        done = self._done
        if done is None:
            done = self._done = self.pool.lease_release(self)
        return done

    def release_when(self, future: Any) -> None:
        """Release when `future` (a concurrent.futures or asyncio future) is done, whatever its
        outcome."""
        future.add_done_callback(lambda _f: self.release())

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return (
            f"Lease({self.lease_id}, {self.mode!r}, holder={self.holder!r}, "
            f"{len(self.blocks)} blocks, {state})"
        )


def lease_rows(view: SegmentView) -> list[dict[str, Any]]:
    """The leases held in the pool, oldest first: one dict each (the keys of `analyze --json`'s
    `leases`)."""
    recs = view.leases
    held = recs["state"] != LeaseState.EMPTY
    out = []
    for i in held.nonzero()[0]:
        r = recs[i]
        k = min(int(r["num_blocks"]), len(r["blocks"]))
        out.append(
            {
                "id": int(r["lease_id"]),
                "mode": "write" if int(r["mode"]) == LeaseMode.WRITE else "read",
                "holder": field_text(r["holder"]),
                "pid": int(r["holder_pid"]),
                "request": field_text(r["request"]),
                "blocks": [int(b) for b in r["blocks"][:k]],
                "taken_ns": int(r["taken_ns"]),
                "leaked": int(r["state"]) == LeaseState.LEAKED,
            }
        )
    return sorted(out, key=lambda d: d["id"])


def lease_totals(view: SegmentView) -> dict[str, int]:
    """The lease section's counters: held now, blocks quarantined by them, and since creation
    taken, released, late (transfer_after_free), leaked and reclaimed."""
    h = view.lease_header[0]
    return {
        "held": int(h["active"]),
        "quarantined": int(h["quarantined"]),
        **{k: int(h[k]) for k in ("taken", "released", "late", "leaked", "reclaimed")},
    }
