"""The whole-pool check's free lists: the free ring and each process's local cache hold every
free block once, and nothing else."""

from __future__ import annotations

import numpy as np

from kvscope.allocator.checkreport import CheckReport, state_name
from kvscope.allocator.findings import Finding, FindingKind
from kvscope.allocator.layout import BlockState, ClientState, SegmentView
from kvscope.allocator.ranges import local_cache


def check_ring(r: CheckReport, view: SegmentView) -> tuple[np.ndarray, int]:
    """The free ring's head, tail and ids; returns how many times each block is in the ring,
    and the ring's count (capped at the pool's size)."""
    n = len(view.blocks)
    rh = view.ring_header[0]
    count, head_pos, tail_pos = int(rh["count"]), int(rh["head"]), int(rh["tail"])
    if count > n:
        r.add(
            Finding(
                FindingKind.FREE_LIST_CORRUPT,
                f"free ring count {count} exceeds the {n} blocks of the pool",
            )
        )
        count = n
    elif (tail_pos - head_pos) % 2**64 != count:
        r.add(
            Finding(
                FindingKind.FREE_LIST_CORRUPT,
                f"free ring head {head_pos} and tail {tail_pos} do not span its count {count}",
            )
        )
    # Positions are taken modulo the pool in Python ints: a head near 2**64 must not overflow.
    start = head_pos % max(n, 1)
    if start + count <= n:
        # The common case, one slice: no index arithmetic over a million entries.
        ring_ids = view.ring[start : start + count].astype(np.int64)
    else:
        ring_ids = view.ring[(start + np.arange(count)) % max(n, 1)].astype(np.int64)
    oob = (ring_ids < 0) | (ring_ids >= n)
    if oob.any():
        r.add(
            Finding(
                FindingKind.FREE_LIST_CORRUPT,
                f"free ring holds {int(oob.sum())} ids outside [0, {n})",
            )
        )
        ring_ids = ring_ids[~oob]
    in_ring = np.bincount(ring_ids, minlength=n)
    r.blocks(
        FindingKind.DOUBLE_FREE,
        np.flatnonzero(in_ring > 1),
        lambda x: f"block is in the free ring {int(in_ring[x])} times: it was freed more than once",
    )
    return in_ring, count


def check_local_caches(r: CheckReport, owned_by_dead: np.ndarray, corrupt: np.ndarray) -> None:
    """Each attached process's local cache holds only LOCAL blocks it owns, and every LOCAL
    block is in a cache (or its owner died: the leak part reports that)."""
    clients = r.view.clients
    state, owner = r.cols.state, r.cols.owner_client
    n = len(state)
    local_ids = np.zeros(n, bool)
    for c in np.flatnonzero(clients["state"] == ClientState.ATTACHED).tolist():
        loc = local_cache(r.add, clients, c, n)
        local_ids[loc] = True
        wrong = loc[(state[loc] != BlockState.LOCAL) | (owner[loc] != c)]
        r.blocks(
            FindingKind.FREE_LIST_CORRUPT,
            wrong,
            lambda x, c=c: (  # type: ignore[misc]  # mypy cannot infer a lambda with defaults
                f"block is in the local cache of pid {int(clients['pid'][c])} but is {state_name(int(state[x]))}"
            ),
        )
    stray_local = np.flatnonzero(
        (state == BlockState.LOCAL) & ~local_ids & ~owned_by_dead & ~corrupt
    )
    r.blocks(
        FindingKind.FREE_LIST_CORRUPT,
        stray_local,
        lambda x: "block is LOCAL but in no process's local cache",
    )


def check_free_count(r: CheckReport, in_ring: np.ndarray, count: int) -> None:
    """The ring's count against the blocks in a free state (unless a double free explains it)."""
    state = r.cols.state
    n_free = int(((state == BlockState.FREE) | (state == BlockState.QUARANTINED)).sum())
    if count != n_free and not (in_ring > 1).any():
        r.add(
            Finding(
                FindingKind.FREE_LIST_CORRUPT,
                f"free ring count is {count} but {n_free} blocks are FREE",
            )
        )
