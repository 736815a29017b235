"""The analysis behind `analyze`, `check` and `run`: findings, owners and events of one segment view.

`analyze_view` returns the JSON object of docs/CLI.md (`pool`, `healthy`, `summary`, `findings`);
`kvscope.report` renders it for a person. Every pass over blocks is vectorised.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np

from kvscope.allocator.events import events_of_process, hit_blocks
from kvscope.allocator.findings import ERROR, Finding, FindingKind
from kvscope.allocator.findingset import Origin, pool_findings
from kvscope.allocator.idle import overtaken
from kvscope.allocator.integrity import (
    UNWRITTEN_AT_PUBLISH,
    unwritten_positions,
    unwritten_span,
)
from kvscope.allocator.layout import (
    BlockState,
    SegmentView,
    SeqState,
)
from kvscope.allocator.process import is_alive
from kvscope.allocator.records import REQUEST_BYTES
from kvscope.allocator.sites import site_frames
from kvscope.poolsummary import Alive, pool_info, some, summary
from kvscope.poolsummary import field_text as _s

if TYPE_CHECKING:
    from kvscope.allocator.kvread import KVData


def op_names() -> dict[int, str]:
    """Event op codes to names (the flight recorder's vocabulary)."""
    # From the allocator itself: kvscope.probes would import the pool, and torch.
    from kvscope.allocator.events import OP_NAMES

    return dict(OP_NAMES)


def _recorded(view: SegmentView, blocks: list[int]) -> np.ndarray:
    """Every event of the flight recorder (all clients' rings) that touched one of blocks,
    oldest first."""
    ev = view.events.reshape(-1)
    ev = ev[(ev["time_ns"] != 0) & np.isin(ev["block"], np.asarray(blocks, np.int32))]
    return ev[np.argsort(ev["time_ns"], kind="stable")]


def _finding_generation(
    view: SegmentView, blk: int, until: int
) -> tuple[np.ndarray, int, np.ndarray] | None:
    """Block `blk`'s recorded events, the generation of the newest `finding` event on it at or
    before `until` (the generation the finding saw), and that generation's finding events up
    to then, oldest first; None when the ring holds no such event."""
    from kvscope.allocator.events import EventOp

    ev = _recorded(view, [blk])
    seen = ev[(ev["op"] == EventOp.FINDING) & (ev["time_ns"] <= until)]
    if not len(seen):
        return None
    generation = int(seen["generation"][-1])
    return ev, generation, seen[seen["generation"] == generation]


def _requests_of(raw: np.ndarray, skip: str | None = None) -> list[str]:
    """The requests of recorded events' `request` fields, each once, in order (none empty, and
    not `skip`)."""
    out: list[str] = []
    for r in map(_s, raw):
        if r and r != skip and r not in out:
            out.append(r)
    return out


def _event_dicts(ev: np.ndarray) -> list[dict[str, Any]]:
    """Recorded events as the report's dicts, in their order."""
    names = op_names()
    return [
        {
            "time_ns": int(e["time_ns"]),
            "pid": int(e["pid"]),
            "op": names.get(int(e["op"]), int(e["op"])),
            "block": int(e["block"]),
            "generation": int(e["generation"]),
            "arg": int(e["arg"]),
            "request": _s(e["request"]) or None,
        }
        for e in ev
    ]


def block_events(view: SegmentView, blocks: list[int]) -> dict[int, list[dict[str, Any]]]:
    """Every event the flight recorder still holds that touched each of blocks, oldest first."""
    if not blocks:
        return {}
    ev = _recorded(view, blocks)
    if not len(ev):
        return {}
    out: dict[int, list[dict[str, Any]]] = {}
    for blk in np.unique(ev["block"]).tolist():
        out[blk] = _event_dicts(ev[ev["block"] == blk])
    return out


# Findings of a block that say what a request which took it by a prefix hit read.
_READ_KINDS = (
    FindingKind.PUBLISHED_BLOCK_MODIFIED,
    FindingKind.KV_NEVER_WRITTEN,
    FindingKind.FOREIGN_SLOT,
)


def mapped_since_published(
    view: SegmentView, blk: int, until_ns: int, ops: tuple[str, ...] = ("PREFIX_HIT", "FORK")
) -> list[str] | None:
    """A `published_block_modified` finding's suspects: the requests the flight recorder saw
    mapping block `blk` through a prefix hit or a fork (`ops`) in the generation the finding
    saw it in (its `finding` event's, the newest at or before `until_ns`), before the finding,
    oldest first. With the block's publisher they are every request whose block table held it
    while it was published. None when the ring no longer holds the finding's event."""
    from kvscope.allocator.events import EventOp

    found = _finding_generation(view, blk, until_ns)
    if found is None:
        return None
    ev, generation, seen = found
    at = int(seen["time_ns"][-1])
    takes = np.isin(ev["op"], [int(EventOp[op]) for op in ops])
    return _requests_of(
        ev[takes & (ev["generation"] == generation) & (ev["time_ns"] <= at)]["request"]
    )


def copied_from(view: SegmentView, blk: int, until: int | None) -> int | None:
    """The block that the copy-on-write that made `blk` (an `append` of a shared partial
    block, its flight-recorder `cow` event: recorded on the source, `arg` the copy) copied
    from, in the allocation of `blk` current at `until` (no `allocate` of it since the copy):
    whichever request's append made it (a sample forked from that request shares it); None
    when the recorder holds none."""
    from kvscope.allocator.events import EventOp

    ev = view.events.reshape(-1)
    ev = ev[ev["time_ns"] != 0]
    if until:
        ev = ev[ev["time_ns"] <= until]
    allocated = ev["time_ns"][(ev["op"] == EventOp.ALLOCATE) & (ev["block"] == blk)]
    since = int(allocated.max()) if len(allocated) else 0
    cows = ev[(ev["op"] == EventOp.COW) & (ev["arg"] == blk) & (ev["time_ns"] >= since)]
    if not len(cows):
        return None
    return int(cows["block"][np.argmax(cows["time_ns"])])


def _request_events(view: SegmentView, request: str, until: int) -> np.ndarray:
    """Every event the flight recorder holds in `request`'s name (any block, any process) up
    to `until`, oldest first."""
    ev = view.events.reshape(-1)
    ev = ev[(ev["time_ns"] != 0) & (ev["time_ns"] <= until) & (ev["request"] == _key(request))]
    return ev[np.argsort(ev["time_ns"], kind="stable")]


def preempted_before(view: SegmentView, request: str | None, blk: int, until: int) -> list[int]:
    """The blocks `request` gave up to its last preemption (its flight-recorder `preempt`
    events) when block `blk` is one its `resume` took fresh after it (an `allocate` in the run
    of `allocate`, `prefix_hit` and `prefix_miss` events of the request that follows the
    preemption's, before its next event of another kind): positions the engine writes after
    the resume. A block the resume's prefix hit mapped holds what was written before the
    preemption, which the resume does not write. Empty otherwise, or where the recorder no
    longer holds them."""
    from kvscope.allocator.events import EventOp

    if not request:
        return []
    ev = _request_events(view, request, until)
    # (a finding in the request's name, any process's, is no operation of it: not one that
    # ends the resume's run of takes)
    ev = ev[~np.isin(ev["op"], [EventOp.FINDING, EventOp.GUARD_VIOLATION])]
    ops = ev["op"]
    preempts = np.flatnonzero(ops == EventOp.PREEMPT)
    if not len(preempts):
        return []
    last = int(preempts[-1])
    # (the preemption's `free` events follow its `preempt` events; a resume looks its prompt
    # up, its `prefix_miss` an event of no block, among its takes)
    begin = last + 1
    while begin < len(ev) and ops[begin] == EventOp.FREE:
        begin += 1
    takes = np.isin(ops, [EventOp.ALLOCATE, EventOp.PREFIX_HIT, EventOp.PREFIX_MISS])
    end = begin
    while end < len(ev) and takes[end]:
        end += 1
    fresh = ev["block"][begin:end][ops[begin:end] == EventOp.ALLOCATE]
    if blk not in fresh.tolist():
        return []
    first = last  # this preemption's events: the run of preempt events that ends at `last`
    while first > 0 and ops[first - 1] == EventOp.PREEMPT:
        first -= 1
    return list(dict.fromkeys(int(b) for b in ev["block"][first : last + 1]))


def reused_while_live(view: SegmentView, request: str | None) -> list[dict[str, Any]]:
    """The live sequences of `request` (a leak's) whose request id the same process gave to
    another sequence after it was created (the flight recorder's `allocate` events of that
    id, whose `arg` is the allocating sequence's id; not for an id with a `fork` event: a
    fork's child shares its parent's id by design): a request id reused while the old request still held its blocks,
    as an engine does that keys its requests by id and so loses the old one. Each as
    {seq_id, created_ns, reused_by (the other sequence ids, first 4), reused_ns (the first
    such allocation)}; empty when the recorder holds none."""
    from kvscope.allocator.events import EventOp

    if not request:
        return []
    key = _key(request)
    seqs = view.seqs
    live = np.flatnonzero((seqs["state"] != SeqState.EMPTY) & (seqs["request"] == key))
    if not len(live):
        return []
    ev = view.events.reshape(-1)
    ev = ev[(ev["time_ns"] != 0) & (ev["request"] == key)]
    if (ev["op"] == EventOp.FORK).any():
        return []  # (a fork's event names its parent: which sequences are forks is not known)
    mine = {int(seqs["seq_id"][s]) for s in live.tolist()}
    allocs = ev[ev["op"] == EventOp.ALLOCATE]
    allocs = allocs[np.argsort(allocs["time_ns"], kind="stable")]
    out: list[dict[str, Any]] = []
    for s in live.tolist():
        sid, born = int(seqs["seq_id"][s]), int(seqs["created_ns"][s])
        later = allocs[(allocs["time_ns"] > born) & (allocs["pid"] == seqs["owner_pid"][s])]
        others = [a for a in dict.fromkeys(later["arg"].tolist()) if a not in mine]
        if others:
            first = later[later["arg"] == others[0]]
            out.append(
                {
                    "seq_id": sid,
                    "created_ns": born,
                    "reused_by": others[:4],
                    "reused_ns": int(first["time_ns"][0]),
                }
            )
    return out


def served_after(view: SegmentView, request: str | None, pid: int | None) -> dict[str, Any] | None:
    """A leaked request that its process stopped serving: the requests of the same process
    whose whole life (first event to a `free` or `abort`) the flight recorder shows after the
    leaked request's last operation. {last_ns, last_op, requests (the first 4), count}; None
    when there is none, or the recorder holds no operation of the request (a request served
    until the end, as at a crash, is not it) or a `free` or `abort` of it (its id named
    another sequence too, which ended)."""
    from kvscope.allocator.events import OP_NAMES, EventOp

    if not request or not pid:
        return None
    ev = view.events.reshape(-1)
    ev = ev[(ev["time_ns"] != 0) & (ev["pid"] == pid)]
    ev = ev[~np.isin(ev["op"], [EventOp.FINDING, EventOp.GUARD_VIOLATION])]
    key = _key(request)
    mine = ev[ev["request"] == key]
    if not len(mine) or np.isin(mine["op"], [EventOp.FREE, EventOp.ABORT]).any():
        # (an end of the id's in its own process: another sequence of the same id ended, and
        # the recorder cannot tell which operations were the leaked one's)
        return None
    at = int(mine["time_ns"].max())
    ops = mine[mine["op"] != EventOp.PREFIX_MISS]  # (an allocate's lookup, no block of its own)
    pick = ops if len(ops) else mine
    last = pick[np.argmax(pick["time_ns"])]
    served = overtaken(view, pid, key, at)
    if not served:
        return None
    return {
        "last_ns": at,
        "last_op": OP_NAMES.get(int(last["op"]), str(int(last["op"]))),
        "requests": served[:4],
        "count": len(served),
    }


def readmitted_after_abort(view: SegmentView, request: str | None, until: int) -> int | None:
    """When the flight recorder shows `request` aborted by the program (an `abort` event of
    `arg` 0, any block, any process) and then allocated again before `until`: the time of
    that allocation (a retry of the request under its id); else None."""
    from kvscope.allocator.events import EventOp

    if not request:
        return None
    ev = _request_events(view, request, until)
    aborts = ev["time_ns"][(ev["op"] == EventOp.ABORT) & (ev["arg"] == 0)]
    if not len(aborts):
        return None
    again = ev["time_ns"][(ev["op"] == EventOp.ALLOCATE) & (ev["time_ns"] > aborts.max())]
    return int(again.min()) if len(again) else None


def hits_on_unwritten(view: SegmentView, blk: int, request: str | None, until: int) -> list[str]:
    """A kv_never_written finding's readers: the requests other than its own whose prefix hits
    mapped block `blk` in the generation the finding saw it in (its `finding` event's, the
    newest at or before `until`), before or after the finding: the block was published with
    positions nobody wrote, and stays so while it is cached, so each of them read K/V nobody
    had written. Oldest first; empty when the ring holds no such hit or no finding event."""
    from kvscope.allocator.events import EventOp

    found = _finding_generation(view, blk, until)
    if found is None:
        return []
    ev, generation, _ = found
    hits = ev[(ev["op"] == EventOp.PREFIX_HIT) & (ev["generation"] == generation)]
    return _requests_of(hits["request"], skip=request)


def held_since_intact(
    view: SegmentView, blk: int, until: int
) -> tuple[dict[str, Any], list[str]] | None:
    """A digest change's narrower suspects, on a CPU pool, whose core verifies a published
    block's digest at once at every prefix hit and release (the digest probe): the last hit or
    release of the block before its first finding, in the generation the finding saw, found its
    K/V intact, so the write came after it, from a request that held the block then or took it
    since (or one whose table or slots point at a block it does not map). (that event, those
    requests), or None when the recorder holds no such check. A process that reported a finding
    on the block before (a handle reports once per kind and block) proves nothing by its
    checks."""
    from kvscope.allocator.events import EventOp

    ev = _recorded(view, [blk])
    seen = ev[(ev["op"] == EventOp.FINDING) & (ev["time_ns"] <= until)]
    if not len(seen):
        return None
    generation = int(seen["generation"][-1])
    mine = ev[ev["generation"] == generation]
    found = mine[mine["op"] == EventOp.FINDING]
    first = int(found["time_ns"].min())
    # (pids whose handle reported on this block before: their later checks are silent)
    told = set(ev["pid"][(ev["op"] == EventOp.FINDING) & (ev["time_ns"] < first)].tolist())
    takes = (EventOp.ALLOCATE, EventOp.PREFIX_HIT, EventOp.FORK)
    releases = (EventOp.FREE, EventOp.ABORT, EventOp.PREEMPT, EventOp.COW)
    checks = (EventOp.PREFIX_HIT, EventOp.FREE, EventOp.ABORT, EventOp.PREEMPT)
    holders: list[str] = []
    intact = None
    since: list[str] = []
    for e in mine[mine["time_ns"] < first]:
        op, req = int(e["op"]), _s(e["request"])
        if op in takes and req and req not in holders:
            holders.append(req)
        elif op in releases and req in holders:
            holders.remove(req)
        if op in checks and int(e["pid"]) not in told:
            intact, since = e, list(holders)
        elif intact is not None and op in takes and req and req not in since:
            since.append(req)
    if intact is None:
        return None
    event = {
        "time_ns": int(intact["time_ns"]),
        "pid": int(intact["pid"]),
        "op": op_names().get(int(intact["op"]), int(intact["op"])),
        "request": _s(intact["request"]) or None,
    }
    return event, since


def _hits_before_found(view: SegmentView, blk: int, until: int) -> tuple[list[str], int] | None:
    """The requests whose prefix hits mapped block `blk` before the first `finding` event on
    it (any process's) in the generation of the newest one at or before `until`, oldest
    first, and that first finding's time; None when the ring holds no finding event."""
    from kvscope.allocator.events import EventOp

    found = _finding_generation(view, blk, until)
    if found is None:
        return None
    ev, generation, seen = found
    first = int(seen["time_ns"][0])
    hits = ev[
        (ev["op"] == EventOp.PREFIX_HIT)
        & (ev["generation"] == generation)
        & (ev["time_ns"] < first)
    ]
    return _requests_of(hits["request"]), first


def _published_blank(d: dict[str, Any], view: SegmentView, blk: int, until: int) -> None:
    """A block published before its K/V was written (its digest at publication is a blank
    block's): every prefix hit that verified it before the first finding on it (in the
    generation this finding saw) found it still blank, so those requests read K/V nobody had
    written (`read_unwritten`), the first of them is the first bad event, and the writer is its
    publisher, after publishing. A hit at or after the first finding is not one of them: the
    K/V had changed by then (that hit is what found it, or came after what did; a second
    process's handle reports the same change again at its own later hit)."""
    publishes = [
        e["time_ns"]
        for e in d["events"]
        if e["op"] == "publish" and e["request"] == d.get("request") and e["time_ns"] <= until
    ]
    if publishes:
        # Published by a resume's blocks: the K/V went where the table from before the
        # preemption pointed (or was never recomputed), not into the block (likely_causes).
        lost = preempted_before(view, d.get("request"), blk, publishes[-1])
        if lost:
            d["preempted_blocks"] = lost
    # (the ring records what a hit found before the hit itself: that hit is not before it)
    found = _hits_before_found(view, blk, until)
    if found is None or not found[0]:
        return
    readers, first = found
    d["read_unwritten"] = readers
    hits = [
        e
        for e in d["events"]
        if e["op"] == "prefix_hit" and e["request"] in readers and e["time_ns"] < first
    ]
    if hits:
        d["first_bad_event"] = hits[0]


# How an event changes the number of references to its block (None: to an unknown number).
_TAKES = {"alloc": 1, "allocate": 1, "prefix_hit": 1, "fork": 1}
_DROPS = {"free": 1, "release": 1, "abort": 1, "cow": 1}
# Events a probe records about a block, in the generation it saw (a finding at an eviction or
# a release names the generation just released): what was found, not what the program did.
_REPORTS = {"finding", "guard_violation"}


def first_bad_event(events: list[dict[str, Any]], generation: int) -> dict[str, Any] | None:
    """The first event the flight recorder shows going wrong: a release of a block nobody held
    any more (a double free; shared blocks are counted by reference from their allocation on),
    or an operation on a generation already released.
    """
    refs: dict[int, int | None] = {}  # generation -> references held, None while unknown
    freed: set[int] = set()
    for e in events:
        op, gen = e["op"], e["generation"]
        if op in _REPORTS:
            continue  # a probe's report about the block, not an operation on it
        if op in ("alloc", "allocate"):
            refs[gen] = 1
            freed.discard(gen)
        elif op in _TAKES:
            # (a published block with no reference left stays cached: a prefix hit takes it)
            freed.discard(gen)
            held = refs.get(gen)
            refs[gen] = None if held is None else held + 1
        elif op in _DROPS:
            if gen in freed:
                return e
            held = refs.get(gen)
            if held is not None:
                refs[gen] = held - 1
                if held - 1 == 0:
                    freed.add(gen)
        elif op == "reclaim":
            refs[gen] = None
        elif isinstance(op, str) and gen and gen < generation and gen in freed:
            return e
    return None


def _site_keys(view: SegmentView, site_id: int) -> dict[str, Any]:
    """A site id as a finding's or a block's `site` (its frames joined, None when not recorded)
    and, for a stack of several frames, `stack`."""
    frames = site_frames(view, site_id)
    keys: dict[str, Any] = {"site": " <- ".join(frames) or None}
    if len(frames) > 1:
        keys["stack"] = frames
    return keys


def _block_detail(view: SegmentView, blk: int) -> dict[str, Any]:
    b = view.blocks[blk]
    site = _site_keys(view, int(b["site"]))
    st = int(b["state"])
    detail = {
        "state": BlockState(st).name.lower() if st < len(BlockState) else f"invalid({st})",
        "refcount": int(b["refcount"]),
        "generation": int(b["generation"]),
        "owner_pid": int(b["owner_pid"]) or None,
        "request": _s(b["request"]) or None,
        "site": site["site"],
        "alloc_ns": int(b["alloc_ns"]),
        "access_ns": int(b["access_ns"]),
        "num_tokens": int(b["num_tokens"]),
        "prefix_hash": f"{int(b['prefix_hash']):#018x}",
    }
    if "stack" in site:
        detail["stack"] = site["stack"]
    return detail


def collect_findings(view: SegmentView, alive: Alive, kv: KVData | None = None) -> list[Finding]:
    """Every finding of a copy read from nowhere else (with `kv`, its KV data's checks too):
    `kvscope.allocator.findingset.pool_findings`, the one assembly every reader uses."""
    return pool_findings(view, Origin(alive=alive, data=kv)).findings


def moment(d: dict[str, Any]) -> int | None:
    """When a finding (of `analyze_view`) went wrong: its first bad event's time, or the time
    it was recorded, whichever is earlier; None when neither is known (a check's finding
    whose block's events show nothing wrong)."""
    times = [t for t in ((d.get("first_bad_event") or {}).get("time_ns"), d.get("time_ns")) if t]
    return min(times) if times else None


def _order(d: dict[str, Any]) -> tuple[bool, bool, int, str]:
    """Errors first; in each severity, the finding whose first bad event came first, first;
    findings with no known moment after those, by kind."""
    at = moment(d)
    return (d["severity"] != ERROR, at is None, at or 0, d["kind"])


def analyze_view(
    view: SegmentView,
    *,
    alive: Alive = is_alive,
    dump_header: np.void | None = None,
    block: int | None = None,
    request: str | None = None,
    findings: list[Finding] | None = None,
    kv: KVData | None = None,
) -> dict[str, Any]:
    """The report of docs/CLI.md for one view, optionally narrowed to one block or one request."""
    found = (
        pool_findings(view, Origin(alive=alive, data=kv)).findings if findings is None else findings
    )
    header_ok = not any(f.kind == "header_corrupt" for f in found)
    if block is not None:
        found = [f for f in found if f.block == block]
    if request is not None:
        # (its own findings, and those of the blocks it took through a prefix hit: a shared
        # block another request corrupted, or published blank, is what this one read)
        hit = hit_blocks(view, _key(request))
        found = [
            f for f in found if f.request == request or (f.block in hit and f.kind in _READ_KINDS)
        ]
    blocks = sorted(
        {f.block for f in found if f.block is not None} | ({block} if block is not None else set())
    )
    blocks = [x for x in blocks if 0 <= x < view.layout.num_blocks]
    events = block_events(view, blocks)
    cpu = str(pool_info(view, dump_header)["device"]).startswith("cpu")
    out_findings = []
    for f in found:
        d = f.to_dict()
        d.update(d.pop("extra", {}))
        if f.kind == FindingKind.LOCK_DEAD_HOLDER and f.owner_pid and not d["events"]:
            # (what the process that died holding the lock last did: the operation it died
            # in is the one after these, rolled back)
            d["events"] = events_of_process(view, f.owner_pid, 8, int(d.get("time_ns") or 0))
        if f.block is not None and 0 <= f.block < view.layout.num_blocks:
            detail = _block_detail(view, f.block)
            again = 0 < int(d.get("time_ns") or 0) < detail["alloc_ns"]  # (allocated since)
            if 0 <= f.site_id and (f.site_id != int(view.blocks[f.block]["site"]) or again):
                # The block was handed out again since the finding (a write after free found
                # at its reuse): name the allocation it saw, whose time the record no longer has.
                d.update(_site_keys(view, f.site_id))
            else:
                d.update({k: detail[k] for k in ("site", "stack", "alloc_ns") if k in detail})
            d["events"] = events.get(f.block, [])
            # (what went wrong before the finding: an event after it is not its cause)
            until = int(d.get("time_ns") or 0)
            bad = first_bad_event(
                [e for e in d["events"] if not until or e["time_ns"] <= until],
                detail["generation"],
            )
            if bad is not None:
                d["first_bad_event"] = bad
            if f.kind == FindingKind.KV_NEVER_WRITTEN:
                src = copied_from(view, f.block, d.get("time_ns"))
                if src is not None:
                    d["copied_from"] = src
                until = int(d.get("time_ns") or np.iinfo(np.int64).max)
                lost = preempted_before(view, f.request, f.block, until)
                if lost:
                    d["preempted_blocks"] = lost
                readers = hits_on_unwritten(view, f.block, f.request, until)
                if readers:
                    d["read_unwritten"] = readers
            if f.kind == FindingKind.LEAK_FINISHED:
                reused = reused_while_live(view, f.request)
                if reused:
                    d["id_reused_while_live"] = reused
                idle = served_after(view, f.request, f.owner_pid)
                if idle is not None:
                    d["served_after"] = idle
            writer = _foreign_store(d)
            if writer is not None and d.get("events"):
                until = int(d.get("time_ns") or np.iinfo(np.int64).max)
                d["writer_recorded_whole"] = writer_recorded_whole(view, writer, until)
            if stored_by(d) is not None:  # (the store probe's: its writer is the request)
                until = int(d.get("time_ns") or np.iinfo(np.int64).max)
                again = readmitted_after_abort(view, f.request, until)
                if again is not None:
                    d["readmitted_after_abort"] = again
            if f.kind == FindingKind.PUBLISHED_BLOCK_MODIFIED:
                until = int(d.get("time_ns") or np.iinfo(np.int64).max)
                if f.message.startswith(UNWRITTEN_AT_PUBLISH):
                    _published_blank(d, view, f.block, until)
                elif stored_by(d) is None or _publisher_stored(d):
                    # (a store names its writer: no suspects to list; but where the writer is
                    # the block's publisher, those that mapped it before that store read K/V
                    # its publisher had not written yet)
                    mapped = mapped_since_published(view, f.block, until)
                    if mapped is not None:
                        d["mapped_since_published"] = mapped
                    held = held_since_intact(view, f.block, until) if cpu else None
                    if held is not None:
                        d["intact_at"], d["held_since_intact"] = held
        out_findings.append(d)
    out_findings.sort(key=_order)
    info = pool_info(view, dump_header)
    report: dict[str, Any] = {
        "pool": info,
        "healthy": not any(d["severity"] == ERROR for d in out_findings),
        "summary": summary(view, alive) if header_ok else {},
        "findings": out_findings,
    }
    by_state = report["summary"].get("blocks_by_state") if header_ok else None
    causes = likely_causes(info["geometry"], out_findings, info.get("dump"), by_state)
    if causes:
        report["likely_causes"] = causes
    if kv is not None:
        report["data_checks"] = {"checked": kv.bits is not None, "unchecked": kv.unchecked}
    if block is not None:
        report["block"] = _focus_block(view, block, events.get(block, []))
    if request is not None:
        report["request"] = _focus_request(view, request)
        if not found and not _request_named(view, request, report["request"]):
            # A mistyped id would otherwise read as a clean bill of health for the pool.
            from kvscope.errors import UsageError

            raise UsageError(
                f"no request {request!r} in this pool: no sequence, block record, finding or "
                "flight-recorder event names it"
            )
    return report


def likely_causes(
    geometry: dict[str, Any],
    findings: list[dict[str, Any]],
    dump: dict[str, Any] | None = None,
    by_state: dict[str, int] | None = None,
) -> list[str]:
    """Causes that a set of findings points at together, one sentence each (docs/CLI.md);
    `dump` the report's `pool.dump` where the findings are a dump's (its program failed, or
    not: the requests it still held when it failed ended with it); `by_state` the pool's blocks
    by state then (the summary's `blocks_by_state`).

    Guard mode gives each block one more slot than it has tokens (`slots_per_block`), so an
    engine that computes a slot as `block * block_size + offset`, right on a plain pool,
    writes each token into the wrong slot under `kvscope run`: some land in guard slots
    (`guard_violation`) and the slots the pool mapped stay unwritten (`kv_never_written`, or
    a block published before its K/V was written). Each of those has other causes alone; the
    two together, in guard mode, are this one's signature."""
    bs, spb = geometry["block_size"], geometry["slots_per_block"]
    kinds = {f["kind"] for f in findings}
    unwritten = FindingKind.KV_NEVER_WRITTEN in kinds or any(map(_blank_at_publish, findings))
    causes = []
    # A decode storing one position late in guard mode sends each block's last position into
    # its own guard slot and leaves the next block's first position unwritten, one slot each:
    # not the slot formula, whose slots land a block's runs elsewhere
    late_in_guard = spb > bs and _one_late_in_guard(findings, bs)
    slots_wrong = (
        spb > bs and FindingKind.GUARD_VIOLATION in kinds and unwritten and not late_in_guard
    )
    if slots_wrong:
        causes.append(
            f"guard slots overwritten and mapped slots left unwritten: does the engine compute a "
            f"slot as block * block_size + offset? A block has {spb} slots for its {bs} tokens "
            f"in guard mode; use pool.slot_mapping(seq, start, end), or block * "
            f"pool.slots_per_block + offset (docs/POOL.md)"
        )
    elif spb > bs and FindingKind.GUARD_VIOLATION in kinds and not late_in_guard:
        over = [
            f
            for f in findings
            if f["kind"] == FindingKind.GUARD_VIOLATION and f.get("block") is not None
        ]
        where = f" ({_blocks_of(over)})" if over else ""
        causes.append(
            f"guard slots overwritten, and no mapped slot left unwritten{where}: K/V for the position right after a full block's last token"
            f" went into that block's guard slot instead of the next block, as a write for one"
            f" position past the sequence's end does when its length is a multiple of"
            f" {bs} (an end + 1, or the slot after the last one worked out by hand), or a write"
            f" for a position before the pool.append that gives it a block; write positions"
            f" [start, end) through pool.slot_mapping(seq, start, end), end at most"
            f" len(seq.tokens)"
        )
    strays = [] if slots_wrong else never_held_writes(findings)
    if strays:
        causes.append(
            f"K/V stored into blocks their writer never held"
            f" ({_writes_into(strays)}): its slots were worked"
            f" out from another sequence's block table (another request's row of a batch"
            f" table: an index off by one, rows out of step with the batch after a finish or a"
            f" preemption), so the writer's own positions stay unwritten; work out each"
            f" sequence's slots from its own table, pool.slot_mapping(seq, start, end)"
        )
    unseen = [] if slots_wrong else unseen_writes(findings)
    if unseen:
        causes.append(
            f"K/V stored into blocks that no operation of their writer the flight recorder still"
            f" holds held ({_writes_into(unseen)}): the"
            f" recorder lost the writer's older events, so its slots were worked out either from"
            f" another sequence's block table or from a table of its own kept from before (a"
            f" preemption, an abort, a copy-on-write); work out each sequence's slots from its"
            f" current table, pool.slot_mapping(seq, start, end) (a larger flight recorder,"
            f" KVSCOPE_EVENT_CAPACITY, tells which)"
        )
    # (a slot formula or another table's row leaves the writer's own positions unwritten
    # anywhere: no cause of an unwritten position beside them)
    slots_wrong = slots_wrong or bool(strays)
    rewritten = [] if slots_wrong else rewritten_by_hitters(findings)
    # (a request that wrote into blocks a preemption took from it writes through its table from
    # before the preemption, which may map a block it now holds by a prefix hit: that one
    # cause, not a prompt stored from position 0 as well)
    preempted = {r for r, _ in lost_to_preemption(findings)} if rewritten else set()
    if rewritten and {r for r, _ in rewritten} <= preempted:
        rewritten = []
    if rewritten:
        named = _blocks_of([{"request": r, "block": b} for r, b in rewritten])
        writers = {r for r, _ in rewritten}
        left = sorted(
            {
                repr(f.get("request"))
                for f in findings
                if f["kind"] == FindingKind.KV_NEVER_WRITTEN and f.get("request") in writers
            }
        )
        own = (
            f"; {some(left, 4)} also left positions of their own unwritten: the K/V of the"
            f" positions after the hit went to slots counted from the hit (the slots of"
            f" positions 0, 1, ...), into the cached blocks"
            if left
            else ""
        )
        causes.append(
            f"published prefix blocks written by requests that hit them ({named}): K/V stored"
            f" into the positions their prefix hit gave them cached, K/V other requests"
            f" share{own}; store a prompt's K/V from seq.num_cached_tokens on, at"
            f" pool.slot_mapping(seq, seq.num_cached_tokens, n)"
        )
    # (a write into the cached blocks leaves the positions after the hit unwritten, in any
    # request that hit them: no other cause of an unwritten position beside it)
    slots_wrong = slots_wrong or bool(rewritten)
    opened = [] if slots_wrong else _block_openers_unwritten(findings, bs)
    # one position late: a forked sample's first decode position is in its copy-on-write
    # copy, so the copy is left with that one position unwritten, as a stale table leaves it
    one_late = _one_late(opened, findings, bs)
    late_copies = _late_copies(findings) if one_late else []
    if opened:
        causes.append(_block_openers_sentence(opened, findings, bs, late_copies))
    alone = [] if slots_wrong else _never_written_alone(findings)
    # (not the block openers, named above; one position late also leaves each request's first
    # decode position unwritten: a single position, the same cause, not a write range that
    # stops short)
    alone = [
        f
        for f in alone
        if not any(f is o for o in opened) and not (one_late and _single_unwritten(f) is not None)
    ]
    # (positions left between written ones: their K/V went to other slots, not a range that
    # stopped short)
    between = [_scattered(f) for f in alone]
    # (and the single or trailing ones where the same code allocated the blocks: one cause)
    sites = {f.get("site") for f, b in zip(alone, between) if b}
    joined = [b or f.get("site") in sites for f, b in zip(alone, between)]
    scattered = [f for f, j in zip(alone, joined) if j]
    alone = [f for f, j in zip(alone, joined) if not j]
    alone = alone if len({f["request"] for f in alone}) > 1 else []
    if alone:
        causes.append(_never_written_sentence(alone))
    if scattered:
        causes.append(_scattered_sentence(scattered))
    # A copy told into a block append handed out as no destination (pool.copied's check): the
    # copies' unwritten positions, in their sources and their destinations, are its doing.
    misdirected = [m.group(1) for f in findings if (m := _MISCOPIED.match(f.get("message", "")))]
    if misdirected:
        named = some(misdirected, 3)
        causes.append(
            f"copy-on-write copies made into blocks append did not hand out as destinations"
            f" ({named}): a copy the wrong way round (dst into src: the shared source, which"
            f" the sequence's siblings still read, overwritten with a copy not yet made) or to"
            f" a block worked out by hand; copy_blocks(kv, src, dst, pool=pool) copies each"
            f" (src, dst) pair append returns from src into dst"
        )
    unexplained = [] if slots_wrong or misdirected else findings
    copied_blank = _copies_of_unwritten(unexplained, bs, {f.get("site") for f in alone})
    skipped, stale = _unwritten_copies(
        [f for f in unexplained if not any(f is c for c in copied_blank + late_copies)], bs
    )
    if copied_blank:
        causes.append(
            f"copy-on-write copies of positions never written in their source block"
            f" ({_copies(copied_blank)}): the copies were made, of K/V that was never stored"
            f" in the source (its own kv_never_written, at the same positions): the K/V of"
            f" those positions went elsewhere (a slot worked out from another request's table,"
            f" a sibling's) or was never computed"
        )
    if skipped:
        causes.append(
            f"copy-on-write copies not made: the first positions of blocks pool.append handed"
            f" out as copies of a shared block were never written ({_copies(skipped)}): perform"
            f" every (src, dst) pair append returns before writing the new token"
            f" (kvscope.kernels.copy_blocks(pool.kv, src, dst, pool=pool))"
        )
    if stale:
        causes.append(
            f"K/V written through a block table from before pool.append copied the block: the"
            f" new token of each went into the shared block it was copied from, which its"
            f" siblings still read, or into another sequence's block through its table"
            f" ({_copies(stale)}): re-read seq.block_table or pool.slot_mapping(seq, start,"
            f" end) after every append, each sequence its own"
        )
    resumed_blank = _resumed_blank(unexplained)
    late = _stored_by_publisher(findings)
    early = None
    if not slots_wrong:
        early = _published_early(
            [f for f in findings if not any(f is r for r in resumed_blank)], late
        )
    if early:
        blanks, readers = early
        read = (
            f", and read by prefix hits as changed since ({_blocks_of(readers)}): the"
            f" foreign_slot findings are those readers"
            if readers
            else ": their publisher stored the K/V after pool.mark_computed published them,"
            " and a prefix hit in between reads K/V nobody wrote"
        )
        causes.append(
            f"blocks published before their K/V was written ({_blocks_of(blanks)}){read};"
            f" call pool.mark_computed(seq, n) only once the K/V of positions [0, n) is stored"
        )
    resumed = [
        f
        for f in unexplained
        if f["kind"] == FindingKind.KV_NEVER_WRITTEN
        and f.get("preempted_blocks")
        and f.get("copied_from") is None  # (a copy's own causes, above)
    ] + resumed_blank
    if resumed:
        causes.append(_resumed_unwritten(resumed, findings))
    blank = [
        f
        for f in unexplained
        if f["kind"] == FindingKind.KV_NEVER_WRITTEN
        and f.get("read_unwritten")
        and f.get("copied_from") is None
        and not f.get("preempted_blocks")
    ]
    if blank:
        hitters = list(dict.fromkeys(repr(r) for f in blank for r in f["read_unwritten"]))
        causes.append(
            f"blocks published with positions never written, then read by prefix hits"
            f" ({_blocks_of(blank)}; read by {some(hitters, 4)}): their"
            f" K/V was stored elsewhere (a slot mapping worked out from another block) or not"
            f" at all before pool.mark_computed published them, and every request that hit"
            f" them read K/V nobody wrote; store the prefill through pool.slot_mapping(seq,"
            f" start, end) and publish only what was stored"
        )
    kept = kept_after_end(findings)
    if kept:
        named = some([f"{r!r} at {where}" for r, where in kept], 3)
        causes.append(
            f"sequences the program still used after it ended their request ({named}): it"
            f" keeps a request it freed or aborted (a cancelled client's, a timed-out one's) in"
            f" a queue or batch and calls the pool on it, catching the PoolError; drop the"
            f" request from every queue and batch on the path that ends it"
        )
    raced = aborted_then_written(findings, explained=slots_wrong)
    retried = {
        (f.get("request"), f.get("block")) for f in findings if f.get("readmitted_after_abort")
    }
    if [x for x in raced if x not in retried]:
        named = some([f"{r!r} block {b}" for r, b in raced if (r, b) not in retried], 4)
        causes.append(
            f"K/V written into blocks after their own request was aborted ({named}): a"
            f" step that worked out its slots before the abort stored through them after it:"
            f" an abort called from another thread while a step runs, or a request kept in the"
            f" running batch after its abort, with the block table it had? Abort between steps"
            f" (queue it for the engine loop) or under the lock the step holds, and drop the"
            f" request from every queue and batch then"
        )
    if [x for x in raced if x in retried]:
        named = some([f"{r!r} block {b}" for r, b in raced if (r, b) in retried], 4)
        causes.append(
            f"K/V written into blocks a request held before it was aborted and admitted again"
            f" ({named}): the engine kept the aborted attempt's block table or slots (under the"
            f" request id it admitted again, or under id(seq), which a new sequence reuses) and"
            f" stored the new attempt's K/V through them; drop a request's tables and slots"
            f" when it is aborted, and work the new sequence's out from it"
            f" (pool.slot_mapping(seq, start, end))"
        )
    reused = [f for f in findings if f.get("id_reused_while_live")]
    if reused:
        named = some(
            [
                f"{f.get('request')!r}: sequence {r['seq_id']} still held block(s) when sequence"
                f" {r['reused_by'][0]} was allocated with its id"
                for f in reused
                for r in f["id_reused_while_live"][:1]
            ],
            3,
        )
        causes.append(
            f"request ids reused while their request still held its blocks ({named}): the"
            f" leaked sequences are the older ones, which the engine lost track of when the id"
            f" came again (requests kept by id?); give each request an id of its own, or end"
            f" the old request before its id is given again"
        )
    oom = _oom_with_blocks_left(dump, by_state)
    if oom:
        causes.append(oom)
    failed_pid = dump["pid"] if dump and dump.get("failed") else None
    hows: dict[str, None] = {}
    cut_short = []
    # (how it failed, and a hang said before it: a hung script stopped)
    reason = str((dump or {}).get("reason") or "").split("; ")
    failure = "; ".join(reason[:1] + [r for r in reason[1:2] if r.startswith("hung ")])
    for f in findings:
        # (a process killed holding requests, by a signal that let no exit check run, leaves
        # them as a dead owner's)
        dead = f["kind"] == FindingKind.LEAK_DEAD_OWNER and f.get("owner_pid") == failed_pid
        if not dead and (f["kind"] != FindingKind.LEAK_FINISHED or f.get("id_reused_while_live")):
            continue  # (a reused id's: its own, above)
        raised = _RAISED.search(f["message"])
        if failed_pid is not None and f.get("owner_pid") == failed_pid:
            hows[failure or "see the dump"] = None
        elif raised:
            # (a process of the program whose exit an exception caused: kvscope.child)
            hows[f"pid {f.get('owner_pid')} raised {raised.group(1)}"] = None
        else:
            continue
        cut_short.append(f)
    cut_ids = {id(f) for f in cut_short}
    if cut_short:
        how = "; ".join(hows)
        named = some(list(dict.fromkeys(repr(f.get("request")) for f in cut_short)), 4)
        causes.append(
            f"requests the program still held when it failed ({named}; {how}):"
            f" they ended with it, not on a path of their own; fix the failure first, and"
            f" release the sequences on the error path too (pool.abort in the handler, or a"
            f" try/finally around the serving loop)"
        )
    idle = [
        f
        for f in findings
        if f.get("served_after")
        and not f.get("id_reused_while_live")  # (its own, above)
        and id(f) not in cut_ids  # (no event shows an append in a block)
    ]
    if idle:
        named = some(
            [
                f"{f.get('request')!r}, last recorded event: {f['served_after']['last_op']}, then"
                f" {f['served_after']['count']} other request(s) began and ended"
                for f in idle
            ],
            3,
        )
        causes.append(
            f"leaked requests the engine stopped serving long before the end ({named}): the"
            f" scheduler dropped them from its queues without pool.free or pool.abort, on a"
            f" path the other requests did not take (an abort, a timeout, an error, a cancelled"
            f" client); release the sequence on every path that ends a request"
        )
    # (the slot formula's stray writes, and another table's row, land in blocks their writer
    # lost too)
    lost = [] if slots_wrong else lost_to_preemption(findings)
    if lost:
        named = some([f"{r!r} block {b}" for r, b in lost], 4)
        causes.append(
            f"K/V written into blocks their request had lost to a preemption ({named}):"
            f" does the engine keep a block table or slot mapping from before a preemption and"
            f" write through it after pool.resume? Re-read pool.block_table(seq) or"
            f' pool.slot_mapping(seq, start, end) after resume (docs/PROBES.md, "What the'
            f' probes do not see")'
        )
    # (those say where such writes came from; so does a slot formula that lands each token in
    # another block's slot)
    explained = early or resumed or lost or slots_wrong
    shifted = [] if explained else _own_prefix_rewritten(late, findings)
    if shifted:
        shifters = {stored_by(f) for f in shifted}
        unwritten_own = [
            f
            for f in findings
            if f["kind"] == FindingKind.KV_NEVER_WRITTEN and f.get("request") in shifters
        ]
        # (first: the copies and hits of the positions it left unwritten follow from it)
        causes.insert(
            0,
            f"requests that stored K/V into their own published prefix blocks"
            f" ({_blocks_of(shifted)}) and left later positions of their own unwritten"
            f" ({_blocks_of(unwritten_own)}): the K/V of later positions went to the slots of"
            f" earlier ones, as a chunked prefill does that stores each chunk at positions counted"
            f" from the chunk's start (0, 1, ...) instead of its own [s, e); store chunk"
            f" [s, e) at pool.slot_mapping(seq, s, e)",
        )
        late = [f for f in late if stored_by(f) not in shifters]
    # (a publisher's own store into a block that prefix hits had taken before it: published
    # before its K/V was written, and read blank)
    read_early = [f for f in late if f.get("mapped_since_published")]
    if read_early and not explained:
        takers = list(
            dict.fromkeys(repr(r) for f in read_early for r in f["mapped_since_published"])
        )
        causes.append(
            f"blocks published before their K/V was written, and taken by prefix hits before"
            f" their publisher stored it ({_blocks_of(read_early)}; taken by"
            f" {some(takers, 4)}): those requests attended to K/V nobody had written; call"
            f" pool.mark_computed(seq, n) only once the K/V of positions [0, n) is stored"
        )
        late = [f for f in late if not f.get("mapped_since_published")]
    if late and not explained:
        causes.append(
            f"published blocks whose K/V changed while no other request mapped them"
            f" ({_blocks_of(late)}): their publisher stored K/V into them after"
            f" pool.mark_computed published them, as a step does that publishes before storing"
            f" the token that fills the block (mark_computed(seq, n) before the K/V of position"
            f" n - 1 is stored, e.g. right after a decode step's append); store the step's K/V"
            f" first, then publish"
        )
    return causes


# Findings that say K/V landed in a block (a digest changed, poison overwritten, a slot
# changed since publication, a store into a block its writer does not map).
_WRITE_TRACES = (
    FindingKind.PUBLISHED_BLOCK_MODIFIED,
    FindingKind.USE_AFTER_FREE,
    FindingKind.FOREIGN_SLOT,
    FindingKind.UNMAPPED_WRITE,
)


def _resumed_unwritten(resumed: list[dict[str, Any]], findings: list[dict[str, Any]]) -> str:
    """The sentence for kv_never_written findings on blocks their request took after a
    preemption (`preempted_blocks`): the positions a resume re-reserved were never written, so
    after pool.resume the engine wrote them elsewhere or not at all; K/V that landed in the
    blocks those requests held before the preemption (a finding of a write there) says where."""
    by: dict[Any, list[int]] = {}
    old: dict[Any, set[int]] = {}
    for f in resumed:
        by.setdefault(f.get("request"), []).append(f["block"])
        old.setdefault(f.get("request"), set()).update(f["preempted_blocks"])
    named = ", ".join(
        f"{r!r} block{'s' if len(b) > 1 else ''} {', '.join(map(str, sorted(set(b))))}"
        for r, b in list(by.items())[:3]
    ) + (f" and {len(by) - 3} more request(s)" if len(by) > 3 else "")
    before = set().union(*old.values())
    landed = sorted(
        {f["block"] for f in findings if f["kind"] in _WRITE_TRACES and f.get("block") in before}
    )
    where = (
        f"; blocks they held before the preemption were written since"
        f" ({_block_list(landed)}): the K/V went through the block table from before the"
        f" preemption"
        if landed
        else ": written through the block table from before the preemption, or not recomputed"
    )
    blank = any(map(_blank_at_publish, resumed))
    never = " (or published them so: mark_computed found them blank)" if blank else ""
    return (
        f"requests preempted and resumed finished with positions never written in blocks"
        f" their resume reserved{never} ({named}){where}. After pool.resume(seq), recompute the"
        f" positions from its cached tokens on into pool.slot_mapping(seq, start, end) (or a"
        f' pool.block_table(seq) read after the resume) (docs/PROBES.md, "What the probes do'
        f' not see")'
    )


def _block_list(blocks: list[int]) -> str:
    """'block 3' or 'blocks 3, 5, 9 and N more'."""
    head = ", ".join(map(str, blocks[:6])) + (
        f" and {len(blocks) - 6} more" if len(blocks) > 6 else ""
    )
    return f"block{'s' if len(blocks) > 1 else ''} {head}"


def _blank_at_publish(f: dict[str, Any]) -> bool:
    """A published_block_modified finding on a block published before its K/V was written."""
    return f["kind"] == FindingKind.PUBLISHED_BLOCK_MODIFIED and f["message"].startswith(
        UNWRITTEN_AT_PUBLISH
    )


def _resumed_blank(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The blocks published blank by a request right after its resume (`preempted_blocks`)
    when K/V landed since in a block that request gave up to the preemption (a finding of a
    write there, other than a blank publication of its own): the resumed request's K/V went
    through its table from before the preemption, so what it published was never written, and
    the publication was not early. Without such a write, an early publication stays the cause."""
    blanks = [f for f in findings if _blank_at_publish(f) and f.get("preempted_blocks")]
    written = {
        f.get("block") for f in findings if f["kind"] in _WRITE_TRACES and not _blank_at_publish(f)
    }
    return [f for f in blanks if written & set(f["preempted_blocks"])]


def _publisher_stored(f: dict[str, Any]) -> bool:
    """A published_block_modified the store probe found in its publisher's own store."""
    writer = stored_by(f)
    return writer is not None and f"published by request {writer!r} " in f["message"]


def _stored_by_publisher(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """published_block_modified findings (not published blank) of a publisher's own store
    after mark_computed: the recorder saw no other request map the block, or the store named
    its publisher as the writer. A store naming another writer is that writer's, and so is a
    change found later on a block such a store, or one into a block its writer does not map,
    wrote into: the writer is known, and it mapped nothing there."""
    foreign = {f.get("block") for f in findings if _foreign_store(f) is not None}
    return [
        f
        for f in findings
        if f["kind"] == FindingKind.PUBLISHED_BLOCK_MODIFIED
        and not _blank_at_publish(f)
        and f.get("block") is not None
        and (
            f.get("mapped_since_published") == [] and f.get("block") not in foreign
            if stored_by(f) is None
            else _publisher_stored(f)
        )
    ]


def _own_prefix_rewritten(
    late: list[dict[str, Any]], findings: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Of the publishers' own stores into their published blocks (`late`), those the store
    named whose writer also finished with positions of its own never written: its K/V went to
    its earlier positions' slots instead (a chunk stored from position 0), not a store made
    after publishing, which leaves nothing unwritten."""
    unwritten = {f.get("request") for f in findings if f["kind"] == FindingKind.KV_NEVER_WRITTEN}
    return [f for f in late if stored_by(f) is not None and stored_by(f) in unwritten]


def _published_early(
    findings: list[dict[str, Any]], late: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
    """When blocks were published blank (their publisher wrote the K/V after mark_computed):
    those, with the publishers' own stores into published blocks (`late`: the same early
    publication, seen at the store), and the foreign_slot findings on any of them (a hit that
    read a slot changed since its publication: the late write itself)."""
    blanks = [f for f in findings if _blank_at_publish(f)]
    if not blanks:
        return None
    blanks += [f for f in late if not any(f is b for b in blanks)]
    blocks = {f.get("block") for f in blanks}
    readers = [
        f
        for f in findings
        if f["kind"] == FindingKind.FOREIGN_SLOT
        and f.get("block") in blocks
        and "since its publication" in f["message"]
    ]
    return blanks, readers


def _blocks_of(found: list[dict[str, Any]]) -> str:
    """ "'a' blocks 0, 1, 'b' block 5 and N more": the first 3 requests' blocks."""
    by: dict[Any, set[int]] = {}
    for f in found:
        by.setdefault(f.get("request"), set()).add(f["block"])
    parts = [
        f"{r!r} block{'s' if len(b) > 1 else ''} {', '.join(map(str, sorted(b)))}"
        for r, b in list(by.items())[:3]
    ]
    return ", ".join(parts) + (f" and {len(by) - 3} more request(s)" if len(by) > 3 else "")


# a leak_finished of a process an exception ended (kvscope.child.exit_when)
_RAISED = re.compile(r" when the process exited raising (\w+)")
# A dump's reason: "child pid N raised Type: message (file:line in function)".
_FAILED_WITH = re.compile(r"raised ([\w.]+)(?::\s*(.*?))?(?: \([^()]*\))?$")
_OUT_OF_MEMORY = re.compile(r"\b(oom|out of memory|memory|no free blocks?)\b", re.IGNORECASE)


def _oom_with_blocks_left(dump: dict[str, Any] | None, by_state: dict[str, int] | None) -> str:
    """A program that failed with an out-of-memory error of its own (a MemoryError, a message
    that says OOM) while the pool had blocks an allocation takes: free ones, cached ones (an
    allocation evicts them) and quarantined ones (guard mode's, handed out when nothing else is
    free). An admission check on stats()["num_free"] alone, which counts neither, fails so.
    The sentence, or ""."""
    if not dump or not dump.get("failed") or not by_state:
        return ""
    reason = str(dump.get("reason") or "").split("; ")[0]
    m = _FAILED_WITH.search(reason)
    if m is None or m.group(1) == "PoolExhausted":
        return ""
    if m.group(1) != "MemoryError" and not _OUT_OF_MEMORY.search(m.group(2) or ""):
        return ""
    free, cached, quarantined = (by_state.get(k, 0) for k in ("free", "cached", "quarantined"))
    if cached + quarantined == 0:
        return ""
    said = f"{m.group(1)}: {m.group(2)}" if m.group(2) else m.group(1)
    parts = [f"{free} free", f"{cached} cached (pool.allocate evicts them as it needs them)"]
    if quarantined:
        parts.append(
            f"{quarantined} quarantined (guard mode's freed blocks, handed out when nothing"
            " else is free)"
        )
    return (
        f"the program failed with {said!r}, and when it was dumped the pool had"
        f" {free + cached + quarantined} blocks an allocation takes ({', '.join(parts)}): an"
        f" admission check that counts stats()['num_free'] alone sees {free} of them; count"
        f" stats()['num_available'] (free, cached and quarantined), or allocate and handle"
        f" PoolExhausted"
    )


def _unwritten_copies(
    findings: list[dict[str, Any]], block_size: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """kv_never_written findings on a copy-on-write copy (`copied_from`), split by what was
    left unwritten: the block's first positions, which only the copy writes (the copy skipped),
    or later ones without the first, the appended token's (written into the copy's source
    through the table from before the append). A copy is only made of a partial block, so the
    appended token is never a block's first position."""
    skipped: list[dict[str, Any]] = []
    stale: list[dict[str, Any]] = []
    for f in findings:
        span = unwritten_span(f["message"]) if f.get("copied_from") is not None else None
        if f["kind"] != FindingKind.KV_NEVER_WRITTEN or span is None:
            continue
        (skipped if span[0] % block_size == 0 else stale).append(f)
    return skipped, stale


def _copies_of_unwritten(
    findings: list[dict[str, Any]], block_size: int, alone_sites: set[Any] | None = None
) -> list[dict[str, Any]]:
    """kv_never_written findings on a copy-on-write copy unwritten from the block's first
    position on (the positions a copy brings: what reads as a skipped copy) whose source block
    has its own kv_never_written finding at overlapping positions, in the generation the copy
    was made from (the source's `cow` event for that copy and its `finding` event agree): the
    copy copied K/V nobody had stored, so the copy is not what was skipped. (Only the appended
    token's position unwritten is the copy's own write gone elsewhere, whatever its source.)

    Later positions unwritten in both count too when the source was allocated at one of
    `alone_sites`, where blocks that no copy touched were left unwritten as well
    (`_never_written_alone`): positions that go unwritten without any copy were unwritten in
    the source before the append copied it, not the appended token's written elsewhere."""
    by_block: dict[int, list[dict[str, Any]]] = {}
    for f in findings:
        if f["kind"] == FindingKind.KV_NEVER_WRITTEN and f.get("block") is not None:
            by_block.setdefault(f["block"], []).append(f)
    out = []
    for f in findings:
        src = f.get("copied_from")
        span = unwritten_span(f["message"]) if src is not None else None
        if f["kind"] != FindingKind.KV_NEVER_WRITTEN or span is None or src is None:
            continue
        lo, hi = span
        for g in by_block.get(int(src), []):
            n = unwritten_span(g["message"])
            # (a source that is itself a copy: its own copy's causes come first)
            if (
                g.get("copied_from") is not None
                or n is None
                or n[1] < lo
                or n[0] > hi
                or (lo % block_size != 0 and g.get("site") not in (alone_sites or ()))
            ):
                continue
            ev = g.get("events") or []
            cow = {
                e.get("generation")
                for e in ev
                if e["op"] == "cow" and e.get("arg") == f["block"] and e["request"] == f["request"]
            }
            seen = {e.get("generation") for e in ev if e["op"] == "finding"}
            if cow & seen:
                out.append(f)
                break
    return out


def _generation_events(f: dict[str, Any]) -> list[dict[str, Any]]:
    """A finding's block events in the generation its `finding` event (the newest at or before
    the finding's time) names; all of them when the recorder holds no such event."""
    events = f.get("events") or []
    until = f.get("time_ns") or None
    seen = [e for e in events if e["op"] == "finding" and (until is None or e["time_ns"] <= until)]
    if not seen:
        return list(events)
    generation = seen[-1].get("generation")
    return [e for e in events if e.get("generation") == generation]


def _single_unwritten(f: dict[str, Any]) -> int | None:
    """The one position a kv_never_written (not on a copy) left unwritten, else None."""
    if f["kind"] != FindingKind.KV_NEVER_WRITTEN or f.get("copied_from") is not None:
        return None
    span = unwritten_span(f.get("message", ""))
    if span is None or span[0] != span[1]:
        return None
    return span[0]


def _block_openers_unwritten(findings: list[dict[str, Any]], bs: int) -> list[dict[str, Any]]:
    """kv_never_written findings of one position each, the first of its block (not position 0:
    a position an append opened a new block for), when there are two or more: the K/V of the
    position that opened each block went elsewhere. Empty otherwise."""
    out = [f for f in findings if (p := _single_unwritten(f)) is not None and p > 0 and p % bs == 0]
    return out if len(out) > 1 else []


def _one_late_in_guard(findings: list[dict[str, Any]], bs: int) -> bool:
    """Whether guard-mode findings read as a decode's K/V stored one position late: block
    openers and first decode positions unwritten (_one_late), every kv_never_written of one
    position (or on a copy), and guard violations on blocks of those requests."""
    opened = _block_openers_unwritten(findings, bs)
    if not opened or not _one_late(opened, findings, bs):
        return False
    never = [f for f in findings if f["kind"] == FindingKind.KV_NEVER_WRITTEN]
    if any(_single_unwritten(f) is None and f.get("copied_from") is None for f in never):
        return False
    requests = {f.get("request") for f in never}
    over = [f for f in findings if f["kind"] == FindingKind.GUARD_VIOLATION]
    return bool(over) and any(f.get("request") in requests for f in over)


def _one_late(opened: list[dict[str, Any]], findings: list[dict[str, Any]], bs: int) -> bool:
    """Whether _block_openers_unwritten's findings read as a decode's K/V stored one position
    late: the same requests' first decode positions (a single position inside a block) are
    unwritten too."""
    requests = {f.get("request") for f in opened}
    return any(
        (p := _single_unwritten(f)) is not None and p % bs != 0 and f.get("request") in requests
        for f in findings
    )


def _late_copies(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kv_never_written findings on a copy-on-write copy (`copied_from`) with one position
    unwritten: the appended token's (a copy is only made of a partial block)."""
    out = []
    for f in findings:
        span = unwritten_span(f.get("message", "")) if f.get("copied_from") is not None else None
        if f["kind"] == FindingKind.KV_NEVER_WRITTEN and span and span[0] == span[1]:
            out.append(f)
    return out


def _block_openers_sentence(
    opened: list[dict[str, Any]],
    findings: list[dict[str, Any]],
    bs: int,
    late_copies: list[dict[str, Any]] | None = None,
) -> str:
    """The cause of _block_openers_unwritten's findings: a decode's slot worked out before the
    append gave it its block (or a write range one short), or one position late (_one_late),
    which also leaves each request's first decode position unwritten, in a forked sample's
    copy-on-write copy too (`late_copies`)."""
    named = some(
        [
            f"{f.get('request')!r} block {f['block']} position {_single_unwritten(f)}"
            for f in opened
        ],
        4,
    )
    copies = (
        f"; the forked samples' copy-on-write copies ({_copies(late_copies)}) are left with"
        " their first decode position unwritten the same way"
        if late_copies
        else ""
    )
    past = (
        "into the block's guard slot (its guard_violation), where the slot after it is worked"
        " out as slot + 1"
        if any(f["kind"] == FindingKind.GUARD_VIOLATION for f in findings)
        else "past the table's end (a padded block table's entry: block 0, or another request's"
        " block)"
    )
    how = (
        "one position late: position n - 1's K/V stored in the slot of position n (n ="
        " seq.num_tokens after the append), which leaves each request's first decode position"
        f" unwritten too, and sends the K/V of a block's last position {past}{copies}"
        if _one_late(opened, findings, bs)
        else "through a slot worked out before pool.append gave the position its block (a block"
        " table or slot mapping from before the append: the new block's entry was missing or"
        " padded), or not at all (a write range that stops one position short)"
    )
    return (
        f"positions never written, each the first slot of its block ({named}): their K/V was"
        f" stored {how}; work out a step's slots after its append, with pool.slot_mapping(seq,"
        f" start, end)"
    )


def _never_written_alone(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kv_never_written findings that nothing but a write never made explains, when there are
    such findings of two requests or more and no finding says that K/V landed anywhere
    (`_WRITE_TRACES`, a guard slot overwritten): each on a block its flight recorder shows no
    copy-on-write or preemption of (in the generation the finding saw; the recorder must hold
    its events), not a copy (`copied_from`), not a copy's source, not resumed into
    (`preempted_blocks`) and not read by prefix hits (`read_unwritten`: their own cause). Its
    positions were reserved by an allocation or an append and their K/V never stored: a write
    range that stops short. Empty otherwise."""
    kinds = {f["kind"] for f in findings}
    if kinds & {*_WRITE_TRACES, FindingKind.GUARD_VIOLATION}:
        return []
    sources = {f.get("copied_from") for f in findings if f.get("copied_from") is not None}
    out = []
    for f in findings:
        if (
            f["kind"] != FindingKind.KV_NEVER_WRITTEN
            or f.get("block") is None
            or f.get("request") is None
            or not f.get("events")
            or unwritten_span(f.get("message", "")) is None
            or f.get("copied_from") is not None
            or f["block"] in sources
            or f.get("preempted_blocks")
            or f.get("read_unwritten")
        ):
            continue
        if any(e["op"] in ("cow", "preempt") for e in _generation_events(f)):
            continue
        out.append(f)
    return out if len({f["request"] for f in out}) > 1 else []


def _writes_into(writes: list[tuple[str, int]]) -> str:
    """(writer, block) pairs as a cause names them: "'w' into block 7", the first 4."""
    return some([f"{w!r} into block {b}" for w, b in writes], 4)


def _scattered(f: dict[str, Any]) -> bool:
    """A kv_never_written whose unwritten positions have written ones between them."""
    got = unwritten_positions(f.get("message", ""))
    return got is not None and got[2] < got[1] - got[0] + 1


def _scattered_sentence(found: list[dict[str, Any]]) -> str:
    """The cause of positions never written between written ones, in blocks nothing else
    explains: each such position's K/V was stored at another slot."""
    named = some([f"{f['request']!r} block {f['block']} ({_positions_of(f)})" for f in found], 4)
    return (
        f"positions never written between written ones ({named}), in blocks that no"
        f" copy-on-write, preemption or prefix hit touched: the K/V of those positions was"
        f" stored at other slots, through a slot worked out from a block table kept from an"
        f" earlier step (stale after an append) or worked out by hand; work out each step's"
        f" slots after its append, with pool.slot_mapping(seq, start, end)"
    )


def _positions_of(f: dict[str, Any]) -> str:
    """A kv_never_written's positions, as its message says them."""
    got = unwritten_positions(f["message"])
    assert got is not None
    first, last, n = got
    if first == last:
        return f"position {first}"
    return (
        f"positions {first}-{last}" if n == last - first + 1 else f"{n} between {first} and {last}"
    )


def _never_written_sentence(alone: list[dict[str, Any]]) -> str:
    """The sentence for `_never_written_alone`'s findings."""
    by: dict[Any, list[str]] = {}
    for f in alone:
        by.setdefault(f["request"], []).append(f"block {f['block']} {_positions_of(f)}")
    named = ", ".join(f"{r!r} {', '.join(b)}" for r, b in list(by.items())[:3]) + (
        f" and {len(by) - 3} more request(s)" if len(by) > 3 else ""
    )
    sites = list(dict.fromkeys(str(f["site"]) for f in alone if f.get("site")))
    if len(sites) == 1 and all(f.get("site") for f in alone):
        at = f", all in blocks allocated at {sites[0]}"
    elif sites:
        at = f", in blocks allocated at {some(sites, 3)}"
    else:
        at = ""
    return (
        f"positions never written in blocks that no copy-on-write, preemption or prefix hit"
        f" touched ({named}){at}; no finding shows K/V landing in a block it does not belong"
        f" to: the engine reserved these positions and never stored their K/V, as a write"
        f" whose range stops short of them does (a prefill must store [seq.num_cached_tokens,"
        f" len(seq.tokens)), every position the allocation reserved; a decode step the"
        f" position it appended): compare each write's range with the positions the"
        f" allocation or append added"
    )


def _copies(found: list[dict[str, Any]]) -> str:
    """The findings as "'a' block 6 copied from 2, ... and N more"."""
    named = ", ".join(
        f"{f.get('request')!r} block {f['block']} copied from {f['copied_from']}" for f in found[:3]
    )
    return named + (f" and {len(found) - 3} more" if len(found) > 3 else "")


def stored_by(f: dict[str, Any]) -> str | None:
    """The writer a store given its writers named in a finding (its message, csrc/stores.c:
    "request 'w' stored K/V into block ..."; the finding's request is that writer), else None."""
    req = f.get("request")
    if req is not None and f["message"].startswith(f"request {req!r} stored K/V into"):
        return str(req)
    return None


def _foreign_store(f: dict[str, Any]) -> str | None:
    """The writer of a store the store probe named into a block another request holds (an
    unmapped_write, or a published block changed by a writer not its publisher); else None."""
    writer = stored_by(f)
    if writer is None or f["kind"] == FindingKind.UNMAPPED_WRITE:
        return writer
    if f["kind"] == FindingKind.PUBLISHED_BLOCK_MODIFIED:
        return None if f"published by request {writer!r} " in f["message"] else writer
    return None


def writer_recorded_whole(view: SegmentView, writer: str, until: int) -> bool:
    """Whether the flight recorder holds every operation of request `writer` up to `until`: no
    process's ring has wrapped, or the oldest event it holds of the request is its first
    allocation (an `allocate`, or a `prefix_hit` that is not a resume's: `arg` 0), so nothing of
    its life before is lost."""
    clients = view.clients
    if (clients["event_head"] <= view.events.shape[1]).all():
        return True
    ev = _request_events(view, writer, until)
    if not len(ev):
        return False
    at = ev[ev["time_ns"] == ev["time_ns"][0]]  # (its oldest operation's events)
    from kvscope.allocator.events import EventOp

    starts = np.isin(at["op"], [EventOp.ALLOCATE, EventOp.PREFIX_HIT, EventOp.PREFIX_MISS])
    resumed = ((at["op"] == EventOp.PREFIX_HIT) & (at["arg"] == 1)).any()
    return bool(starts.any() and not resumed)


def never_held_writes(findings: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """(writer, block) of each store the store probe named into a block another request
    holds (an unmapped_write, or a published block changed by a writer not its publisher)
    whose flight recorder shows no operation of the writer on the block before the finding:
    not a table kept across a preemption, an abort or a copy-on-write (each of those writes
    into a block its writer once held), but another sequence's table. Without the recorder's
    events, none."""
    return _unheld_writes(findings, whole=True)


def unseen_writes(findings: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """As never_held_writes, where the flight recorder lost the writer's older events
    (`writer_recorded_whole` false): whether it once held the block is not known."""
    return _unheld_writes(findings, whole=False)


def _unheld_writes(findings: list[dict[str, Any]], whole: bool) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for f in findings:
        writer, blk, events = _foreign_store(f), f.get("block"), f.get("events")
        if writer is None or blk is None or not events:
            continue
        if f.get("writer_recorded_whole", True) is not whole:
            continue
        held = any(e["op"] != "finding" for e in _block_events_of(f, writer))
        if not held and (writer, blk) not in out:
            out.append((writer, blk))
    return out


# The flight recorder's operations that start or end a request's hold on a block.
_HOLDING = ("allocate", "prefix_hit", "fork", "cow", "preempt", "free", "abort", "evict", "reclaim")


def rewritten_by_hitters(findings: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """(request, block) of each published block a request other than its publisher that
    mapped it by a prefix hit stored into: a store given its writers named that request, whose
    last operation on the block before the finding in the flight recorder is its prefix_hit
    (no release since); or, with no store named, the block's K/V was intact at that request's
    prefix hit (`intact_at`) and no other request held it from then to the finding
    (`held_since_intact` is that request alone); or, with several holders since, those of them
    (not the publisher) that left positions of their own unwritten (`kv_never_written`), as a
    prefill whose slots were counted from the hit does: its K/V went into the cached blocks."""
    unwritten = {f.get("request") for f in findings if f["kind"] == FindingKind.KV_NEVER_WRITTEN}
    out: list[tuple[str, int]] = []
    for f in findings:
        blk = f.get("block")
        if f["kind"] != FindingKind.PUBLISHED_BLOCK_MODIFIED or blk is None:
            continue
        writer = stored_by(f)
        if writer is not None:
            writers = [writer] if _stored_through_hit(f, writer) else []
        else:
            writers = _hitters_since_intact(f, unwritten)
        for w in writers:
            if (str(w), int(blk)) not in out:
                out.append((str(w), int(blk)))
    return out


def _stored_through_hit(f: dict[str, Any], writer: str) -> bool:
    """Whether the store's writer held the published block through a prefix hit when it
    stored: its last operation on the block before the finding is its prefix_hit."""
    if f"published by request {writer!r} " in f["message"]:
        # (its own published block, mapped again by its resume's hit: a table kept across the
        # preemption writes there too, and has causes of its own)
        return False
    held = [e["op"] for e in _block_events_of(f, writer) if e["op"] in _HOLDING]
    return held[-1:] == ["prefix_hit"]


def _hitters_since_intact(f: dict[str, Any], unwritten: set[Any]) -> list[str]:
    """With no store named: the request whose prefix hit found the block's K/V intact when it
    alone held it from then to the finding (not the finding's request, its publisher); with
    several holders since, those of them that left positions of their own unwritten."""
    at = f.get("intact_at") or {}
    if at.get("op") != "prefix_hit":
        return []
    held = f.get("held_since_intact") or []
    if held == [at.get("request")]:
        return [] if held[0] == f.get("request") else held
    return [r for r in held if r != f.get("request") and r in unwritten] if len(held) > 1 else []


def lost_to_preemption(findings: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """(request, block) of each write into a block the finding's request had given up by a
    preemption before the finding (its block's flight recorder shows that request's
    `preempt`): a write after free of a block a preemption freed, or a store into a block
    the writing request no longer maps. Only the kinds that say K/V landed in a block the
    request did not hold: a kv_never_written or a digest change alone has other causes. A
    block the request took again after its last preemption (its resume handed the same block
    back: an `allocate` or `prefix_hit` of that request after the `preempt`) is its own again:
    a write into it is not through a table from before the preemption."""
    out: list[tuple[str, int]] = []
    for f in findings:
        req, blk = f.get("request"), f.get("block")
        if req is None or blk is None:
            continue
        into_other = f["kind"] in (FindingKind.USE_AFTER_FREE, FindingKind.UNMAPPED_WRITE) or (
            f["kind"] == FindingKind.PUBLISHED_BLOCK_MODIFIED and stored_by(f) is not None
        )
        if not into_other:
            continue
        ops = [e["op"] for e in _block_events_of(f, req)]
        if "preempt" not in ops:
            continue
        last = len(ops) - 1 - ops[::-1].index("preempt")
        if not any(op in ("allocate", "prefix_hit") for op in ops[last + 1 :]):
            out.append((req, blk))
    return list(dict.fromkeys(out))  # (a block found twice: at the store, then as poison)


# pool.copied's check of a copy into a block that is no copy-on-write destination.
_MISCOPIED = re.compile(
    r"a copy of (block \d+ into block \d+ at .+?): block \d+ is no copy-on-write"
)

# A use_after_free the core records of a call on a sequence already ended (no block):
# "request 'r0' was already aborted and is used again at engine.py:131 step (append): ...".
_USED_AGAIN = re.compile(r" was already \w+ and is used again at (.+?): the pool refused it")


def kept_after_end(findings: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(request, where: the caller's line and the call) of each call on a sequence whose
    request the program had already freed or aborted (a `use_after_free` about no block)."""
    out = []
    for f in findings:
        if f["kind"] != FindingKind.USE_AFTER_FREE or f.get("block") is not None:
            continue
        m = _USED_AGAIN.search(f.get("message", ""))
        if m and f.get("request") is not None:
            out.append((str(f["request"]), m.group(1)))
    return out


def aborted_then_written(
    findings: list[dict[str, Any]], explained: bool = False
) -> list[tuple[str, int]]:
    """(request, block) of each write after free (`use_after_free`) whose block's last
    release before the finding, in its flight recorder, is that same request's `abort`: K/V
    stored for a request after it was aborted, as a step does whose slots were worked out
    before an abort from another thread. A release by `free` or a preemption is not it (a
    table kept after the end, or across a preemption: another cause). So is a store into the
    block once another request took it (`_aborted_into_reused`).

    Only the store probe names a write's writer ("request 'r' stored K/V into block ..."): a
    write it names is the aborted request's own. A write found later, as poison overwritten
    in quarantine, names only the request that released the block, and any wrong slot lands
    in some block just released: such a write is counted only when nothing else explains it,
    that is, unless `explained` (another cause, as slots worked out with the wrong formula,
    says where stray writes come from) or some other write after free in the findings is not
    an aborted request's own (a block that no abort released, or a writer other than the
    request aborted): then writes land in freed blocks whatever ended their request."""
    out: list[tuple[str, int]] = []
    unnamed: list[tuple[str, int]] = []
    stray = False
    for f in findings:
        req, blk = f.get("request"), f.get("block")
        if req is None or blk is None:
            continue
        if f["kind"] != FindingKind.USE_AFTER_FREE:
            if _aborted_into_reused(f):
                out.append((req, blk))
            continue
        named = f.get("message", "").startswith("request ")  # (the store probe's: the writer)
        until = f.get("time_ns") or None
        ends = [
            e
            for e in f.get("events") or ()
            if e["op"] in ("free", "abort", "preempt") and (until is None or e["time_ns"] <= until)
        ]
        aborted = bool(ends) and _program_abort(ends[-1]) and ends[-1]["request"] == req
        if named and aborted and f["message"].startswith(f"request {req!r} stored K/V into"):
            out.append((req, blk))
        elif aborted and not named:
            unnamed.append((req, blk))
        else:
            stray = True
    if not (explained or stray):
        out.extend(unnamed)
    return list(dict.fromkeys(out))  # (a block found twice: at the store, then as poison)


def _aborted_into_reused(f: dict[str, Any]) -> bool:
    """A store the store probe named into a block another request holds now (an
    unmapped_write, or a published block changed by a writer not its publisher) whose writer's
    own last release of the block before the finding, in its flight recorder, is an `abort`:
    the aborted request's step stored after the block went to another request, in its process
    or another one."""
    writer = _foreign_store(f)
    if writer is None:
        return False
    ends = [e for e in _block_events_of(f, writer) if e["op"] in ("free", "abort", "preempt")]
    return bool(ends) and _program_abort(ends[-1])


def _block_events_of(f: dict[str, Any], request: str) -> list[dict[str, Any]]:
    """The flight-recorder events of the finding's block (its `events`) in `request`'s name up
    to the finding's time (every one where it has none), oldest first."""
    until = f.get("time_ns") or None
    return [
        e
        for e in f.get("events") or ()
        if e["request"] == request and (until is None or e["time_ns"] <= until)
    ]


def _program_abort(e: dict[str, Any]) -> bool:
    """An `abort` event of the program's pool.abort: not one the core made abandoning a
    sequence its own operation could not finish (`arg` 1: a long prompt's or a resume's rest
    failed, and the program got the exception, not the sequence)."""
    return e["op"] == "abort" and not e.get("arg")


def _focus_block(view: SegmentView, blk: int, events: list[dict[str, Any]]) -> dict[str, Any]:
    from kvscope.errors import UsageError

    n = view.layout.num_blocks
    if not 0 <= blk < n:
        raise UsageError(f"block {blk} is out of range: the pool has blocks 0..{n - 1}")
    seqs = view.seqs
    live = np.flatnonzero(seqs["state"] != SeqState.EMPTY)
    tables = seqs["table"][live]
    cols = np.arange(tables.shape[1]) < seqs["num_blocks"][live][:, None]
    mapped = live[((tables == blk) & cols).any(axis=1)]
    d = _block_detail(view, blk)
    d["block"] = blk
    d["mapped_by"] = [_s(seqs["request"][s]) for s in mapped.tolist()]
    d["events"] = events
    return d


def _key(request: str) -> bytes:
    """A request id as the records keep it: its first REQUEST_BYTES bytes of UTF-8."""
    return request.encode()[:REQUEST_BYTES]


def _focus_request(view: SegmentView, request: str) -> dict[str, Any]:
    seqs = view.seqs
    key = _key(request)
    mine = np.flatnonzero((seqs["state"] != SeqState.EMPTY) & (seqs["request"] == key))
    held = np.flatnonzero(
        (view.blocks["request"] == key) & (view.blocks["state"] == BlockState.ALLOCATED)
    )
    return {
        "request": request,
        "sequences": [
            {
                "state": SeqState(int(seqs["state"][s])).name.lower(),
                "owner_pid": int(seqs["owner_pid"][s]),
                "num_tokens": int(seqs["num_tokens"][s]),
                "block_table": seqs["table"][s, : int(seqs["num_blocks"][s])].tolist(),
            }
            for s in mine.tolist()
        ],
        "blocks_stamped": held.tolist()[:1000],
        "num_blocks_stamped": int(len(held)),
        "events": request_events(view, request),
    }


# The flight-recorder events `--request` shows, at most (the newest).
REQUEST_EVENTS = 64


def request_events(view: SegmentView, request: str) -> list[dict[str, Any]]:
    """The flight recorder's events in `request`'s name (every process's ring), oldest first:
    the newest REQUEST_EVENTS of them, one per block an operation touched."""
    everything = int(np.iinfo(np.int64).max)
    return _event_dicts(_request_events(view, request, everything)[-REQUEST_EVENTS:])


def _request_named(view: SegmentView, request: str, focus: dict[str, Any]) -> bool:
    """Whether anything the segment keeps names `request` (its first 32 bytes, as the records
    keep it): a live sequence, a block record in any state, an event of the flight recorder."""
    if focus["sequences"]:
        return True
    key = _key(request)
    if bool((view.blocks["request"] == key).any()):
        return True
    ev = view.events.reshape(-1)
    return bool(((ev["time_ns"] != 0) & (ev["request"] == key)).any())


def exit_code(report: dict[str, Any]) -> int:
    """0 when healthy, 1 when a finding of severity error is present."""
    return 0 if report["healthy"] else 1
