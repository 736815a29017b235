"""The analysis behind `analyze`, `check` and `run`: findings, owners and events of one segment view.

`analyze_view` returns the JSON object of docs/CLI.md (`pool`, `healthy`, `summary`, `findings`);
`kvscope.report` renders it for a person. Every pass over blocks is vectorised.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np

from kvscope.allocator.findings import ERROR, Finding, FindingKind
from kvscope.allocator.findingset import Origin, pool_findings
from kvscope.allocator.integrity import UNWRITTEN_AT_PUBLISH
from kvscope.allocator.layout import (
    BlockState,
    SegmentView,
    SeqState,
)
from kvscope.allocator.process import is_alive
from kvscope.allocator.sites import site_frames
from kvscope.poolsummary import Alive, pool_info, summary
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


def block_events(view: SegmentView, blocks: list[int]) -> dict[int, list[dict[str, Any]]]:
    """Every event the flight recorder still holds that touched each of blocks, oldest first."""
    if not blocks:
        return {}
    ev = _recorded(view, blocks)
    if not len(ev):
        return {}
    names = op_names()
    out: dict[int, list[dict[str, Any]]] = {}
    for blk in np.unique(ev["block"]).tolist():
        mine = ev[ev["block"] == blk]
        out[blk] = [
            {
                "time_ns": int(e["time_ns"]),
                "pid": int(e["pid"]),
                "op": names.get(int(e["op"]), int(e["op"])),
                "block": int(e["block"]),
                "generation": int(e["generation"]),
                "arg": int(e["arg"]),
                "request": _s(e["request"]) or None,
            }
            for e in mine
        ]
    return out


def mapped_since_published(
    view: SegmentView, blk: int, until_ns: int, ops: tuple[str, ...] = ("PREFIX_HIT", "FORK")
) -> list[str] | None:
    """A `published_block_modified` finding's suspects: the requests the flight recorder saw
    mapping block `blk` through a prefix hit or a fork (`ops`) in the generation the finding
    saw it in (its `finding` event's, the newest at or before `until_ns`), before the finding,
    oldest first. With the block's publisher they are every request whose block table held it
    while it was published. None when the ring no longer holds the finding's event."""
    from kvscope.allocator.events import EventOp

    ev = _recorded(view, [blk])
    ev = ev[ev["time_ns"] <= until_ns]
    seen = ev[ev["op"] == EventOp.FINDING]
    if not len(seen):
        return None
    generation, at = int(seen["generation"][-1]), int(seen["time_ns"][-1])
    takes = np.isin(ev["op"], [int(EventOp[op]) for op in ops])
    mine = ev[takes & (ev["generation"] == generation) & (ev["time_ns"] <= at)]
    out: list[str] = []
    for raw in mine["request"]:
        r = _s(raw)
        if r and r not in out:
            out.append(r)
    return out


def copied_from(view: SegmentView, blk: int, request: str | None, until: int | None) -> int | None:
    """The block that the last copy-on-write into `blk` for `request` (an `append` of a shared
    partial block, its flight-recorder `cow` event: recorded on the source, `arg` the copy)
    copied from, before `until`; None when the recorder holds none."""
    from kvscope.allocator.events import EventOp

    ev = view.events.reshape(-1)
    ev = ev[(ev["time_ns"] != 0) & (ev["op"] == EventOp.COW) & (ev["arg"] == blk)]
    if until:
        ev = ev[ev["time_ns"] <= until]
    best = None
    for e in ev[np.argsort(ev["time_ns"], kind="stable")]:
        if request is None or _s(e["request"]) == request:
            best = int(e["block"])
    return best


def _published_blank(d: dict[str, Any], view: SegmentView, blk: int, until: int) -> None:
    """A block published before its K/V was written (its digest at publication is a blank
    block's): every prefix hit that verified it before the finding found it still blank, so
    those requests read K/V nobody had written (`read_unwritten`), the first of them is the
    first bad event, and the writer is its publisher, after publishing."""
    readers = mapped_since_published(view, blk, until, ops=("PREFIX_HIT",))
    if not readers:
        return
    d["read_unwritten"] = readers
    hits = [
        e
        for e in d["events"]
        if e["op"] == "prefix_hit" and e["request"] in readers and e["time_ns"] <= until
    ]
    if hits:
        d["first_bad_event"] = hits[0]


# How an event changes the number of references to its block (None: to an unknown number).
_TAKES = {"alloc": 1, "allocate": 1, "prefix_hit": 1, "fork": 1}
_DROPS = {"free": 1, "release": 1, "abort": 1, "cow": 1}


def first_bad_event(events: list[dict[str, Any]], generation: int) -> dict[str, Any] | None:
    """The first event the flight recorder shows going wrong: a release of a block nobody held
    any more (a double free; shared blocks are counted by reference from their allocation on),
    or an operation on a generation already released.
    """
    refs: dict[int, int | None] = {}  # generation -> references held, None while unknown
    freed: set[int] = set()
    for e in events:
        op, gen = e["op"], e["generation"]
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
        found = [f for f in found if f.request == request]
    blocks = sorted(
        {f.block for f in found if f.block is not None} | ({block} if block is not None else set())
    )
    blocks = [x for x in blocks if 0 <= x < view.layout.num_blocks]
    events = block_events(view, blocks)
    out_findings = []
    for f in found:
        d = f.to_dict()
        d.update(d.pop("extra", {}))
        if f.block is not None and 0 <= f.block < view.layout.num_blocks:
            detail = _block_detail(view, f.block)
            if 0 <= f.site_id != int(view.blocks[f.block]["site"]):
                # The block was handed out again since the finding (a write after free found
                # at its reuse): name the allocation it saw, whose time the record no longer has.
                d.update(_site_keys(view, f.site_id))
            else:
                d.update({k: detail[k] for k in ("site", "stack", "alloc_ns") if k in detail})
            d["events"] = events.get(f.block, [])
            bad = first_bad_event(d["events"], detail["generation"])
            if bad is not None:
                d["first_bad_event"] = bad
            if f.kind == FindingKind.KV_NEVER_WRITTEN:
                src = copied_from(view, f.block, f.request, d.get("time_ns"))
                if src is not None:
                    d["copied_from"] = src
            if f.kind == FindingKind.PUBLISHED_BLOCK_MODIFIED:
                until = int(d.get("time_ns") or np.iinfo(np.int64).max)
                if f.message.startswith(UNWRITTEN_AT_PUBLISH):
                    _published_blank(d, view, f.block, until)
                else:
                    mapped = mapped_since_published(view, f.block, until)
                    if mapped is not None:
                        d["mapped_since_published"] = mapped
        out_findings.append(d)
    out_findings.sort(key=_order)
    info = pool_info(view, dump_header)
    report: dict[str, Any] = {
        "pool": info,
        "healthy": not any(d["severity"] == ERROR for d in out_findings),
        "summary": summary(view, alive) if header_ok else {},
        "findings": out_findings,
    }
    causes = likely_causes(info["geometry"], out_findings)
    if causes:
        report["likely_causes"] = causes
    if kv is not None:
        report["data_checks"] = {"checked": kv.bits is not None, "unchecked": kv.unchecked}
    if block is not None:
        report["block"] = _focus_block(view, block, events.get(block, []))
    if request is not None:
        report["request"] = _focus_request(view, request)
    return report


def likely_causes(geometry: dict[str, Any], findings: list[dict[str, Any]]) -> list[str]:
    """Causes that a set of findings points at together, one sentence each (docs/CLI.md).

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
    if spb > bs and FindingKind.GUARD_VIOLATION in kinds and unwritten:
        causes.append(
            f"guard slots overwritten and mapped slots left unwritten: does the engine compute a "
            f"slot as block * block_size + offset? A block has {spb} slots for its {bs} tokens "
            f"in guard mode; use pool.slot_mapping(seq, start, end), or block * "
            f"pool.slots_per_block + offset (docs/POOL.md)"
        )
    skipped, stale = _unwritten_copies(findings, bs)
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
            f" siblings still read ({_copies(stale)}): re-read seq.block_table or"
            f" pool.slot_mapping(seq, start, end) after every append"
        )
    early = _published_early(findings)
    if early:
        blanks, readers = early
        causes.append(
            f"blocks published before their K/V was written ({_blocks_of(blanks)}), and read by"
            f" prefix hits as changed since ({_blocks_of(readers)}): the foreign_slot findings"
            f" are those readers; call pool.mark_computed(seq, n) only once the K/V of"
            f" positions [0, n) is stored"
        )
    lost = lost_to_preemption(findings)
    if lost:
        named = ", ".join(f"{r!r} block {b}" for r, b in lost[:4])
        more = f" and {len(lost) - 4} more" if len(lost) > 4 else ""
        causes.append(
            f"K/V written into blocks their request had lost to a preemption ({named}{more}):"
            f" does the engine keep a block table or slot mapping from before a preemption and"
            f" write through it after pool.resume? Re-read pool.block_table(seq) or"
            f' pool.slot_mapping(seq, start, end) after resume (docs/PROBES.md, "What the'
            f' probes do not see")'
        )
    return causes


def _blank_at_publish(f: dict[str, Any]) -> bool:
    """A published_block_modified finding on a block published before its K/V was written."""
    return f["kind"] == FindingKind.PUBLISHED_BLOCK_MODIFIED and f["message"].startswith(
        UNWRITTEN_AT_PUBLISH
    )


def _published_early(
    findings: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
    """The blocks published blank (their publisher wrote the K/V after mark_computed) and the
    foreign_slot findings on those same blocks (a hit that read a slot changed since its
    publication: the late write itself), when there are both."""
    blanks = [f for f in findings if _blank_at_publish(f)]
    blocks = {f.get("block") for f in blanks}
    readers = [
        f
        for f in findings
        if f["kind"] == FindingKind.FOREIGN_SLOT
        and f.get("block") in blocks
        and "since its publication" in f["message"]
    ]
    return (blanks, readers) if blanks and readers else None


def _blocks_of(found: list[dict[str, Any]]) -> str:
    """ "'a' blocks 0, 1, 'b' block 5 and N more": the first 3 requests' blocks."""
    by: dict[Any, list[int]] = {}
    for f in found:
        by.setdefault(f.get("request"), []).append(f["block"])
    parts = [
        f"{r!r} block{'s' if len(b) > 1 else ''} {', '.join(map(str, sorted(set(b))))}"
        for r, b in list(by.items())[:3]
    ]
    return ", ".join(parts) + (f" and {len(by) - 3} more request(s)" if len(by) > 3 else "")


_UNWRITTEN = re.compile(r"finished with positions (\d+)-(\d+) ")


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
        m = _UNWRITTEN.search(f["message"]) if f.get("copied_from") is not None else None
        if f["kind"] != FindingKind.KV_NEVER_WRITTEN or m is None:
            continue
        (skipped if int(m.group(1)) % block_size == 0 else stale).append(f)
    return skipped, stale


def _copies(found: list[dict[str, Any]]) -> str:
    """The findings as "'a' block 6 copied from 2, ... and N more"."""
    named = ", ".join(
        f"{f.get('request')!r} block {f['block']} copied from {f['copied_from']}" for f in found[:3]
    )
    return named + (f" and {len(found) - 3} more" if len(found) > 3 else "")


def lost_to_preemption(findings: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """(request, block) of each write into a block the finding's request had given up by a
    preemption before the finding (its block's flight recorder shows that request's
    `preempt`): a write after free of a block a preemption freed, or a store into a block
    the writing request no longer maps. Only the kinds that say K/V landed in a block the
    request did not hold: a kv_never_written or a digest change alone has other causes."""
    out: list[tuple[str, int]] = []
    for f in findings:
        req, blk = f.get("request"), f.get("block")
        if req is None or blk is None:
            continue
        into_other = f["kind"] in (FindingKind.USE_AFTER_FREE, FindingKind.UNMAPPED_WRITE) or (
            f["kind"] == FindingKind.PUBLISHED_BLOCK_MODIFIED
            and f["message"].startswith(f"request {req!r} stored K/V into")
        )
        if not into_other:
            continue
        until = f.get("time_ns") or None
        if any(
            e["op"] == "preempt"
            and e["request"] == req
            and (until is None or e["time_ns"] <= until)
            for e in f.get("events") or ()
        ):
            out.append((req, blk))
    return out


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


def _focus_request(view: SegmentView, request: str) -> dict[str, Any]:
    seqs = view.seqs
    key = request.encode()[:32]
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
    }


def exit_code(report: dict[str, Any]) -> int:
    """0 when healthy, 1 when a finding of severity error is present."""
    return 0 if report["healthy"] else 1
