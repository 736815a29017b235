"""The probes a pool handle runs: flight recorder, ownership sites, guard slots, leak and magic
checks, the digest. The C core runs them inside its operations (`native_bits` says which) and
writes what they find into the findings ring; this is their state on the handle and what runs
between operations: `pool.verify()`, the findings a reader or probe reports (`report`), and the
findings the core wrote, read back for `on_finding` (`ring_findings`). The pool holds
`probe = None` when every one is off; `kvscope run` turns them on through KVSCOPE_* variables
(docs/PROBES.md).
"""

from __future__ import annotations

import re

import numpy as np

from kvscope.allocator import devicechecks, integrity
from kvscope.allocator.checklocks import lock_named
from kvscope.allocator.events import events_for_block, recent_events
from kvscope.allocator.findings import Finding, FindingKind, finding_at
from kvscope.allocator.handle import OwnerRef, PoolHandle
from kvscope.allocator.layout import FINDINGS_CAPACITY
from kvscope.allocator.probeflags import ProbeFlags
from kvscope.allocator.sites import site_text, stack_depth

# Bits of the C core's probe word (allocator/csrc/core.h P_*): the probes it runs itself.
NATIVE_EVENTS, NATIVE_SITES, NATIVE_LEAKS, NATIVE_MAGIC, NATIVE_SITES_EACH = 1, 2, 4, 8, 16
NATIVE_LOCKDEP = 32
NATIVE_GUARD_SAMPLED, NATIVE_GUARD, NATIVE_DIGEST = 64, 128, 256
NATIVE_SITE_DEPTH_SHIFT = 16  # the frames per site, from this bit up


class PoolProbes:
    """Probe state of one pool handle."""

    pool = OwnerRef()  # (the pool holds this as `probe`)

    def __init__(self, pool: PoolHandle, flags: ProbeFlags):
        self.pool = pool
        self.flags = flags
        # frames per allocation site (KVSCOPE_STACK_DEPTH), with the ownership probe
        self.site_depth = stack_depth() if flags.ownership else 0
        self.reported: set[tuple[str, int, str | None]] = set()
        # verify() runs inside pool operations that verify() itself starts: never recurse.
        self.verifying = False
        # The C core's queue of checks of the K/V whose answers come later (a CUDA pool's:
        # devicechecks.py; None where the core checks the bytes itself, in its operations).
        self.later = devicechecks.for_pool(pool, flags)

    def native_bits(self) -> int:
        """The probes as the C core's probe word (P_* of allocator/csrc/core.h)."""
        f = self.flags
        sampled = f.guard and self.pool.guard_sample > 1
        bits = NATIVE_EVENTS * f.events + NATIVE_LEAKS * f.leaks + NATIVE_MAGIC * f.magic
        # Guard mode: every release guarded, or (sampled) those of the requests it samples.
        bits |= NATIVE_GUARD_SAMPLED * sampled | NATIVE_GUARD * (f.guard and not sampled)
        bits |= NATIVE_DIGEST * f.digest
        if self.site_depth:
            bits |= NATIVE_SITES if self.site_depth == 1 else NATIVE_SITES_EACH
            bits |= self.site_depth << NATIVE_SITE_DEPTH_SHIFT
        return bits

    def settle(self, wait: bool = False) -> None:
        """The answers of the K/V checks launched on the GPU that are in (all, with `wait`)."""
        if self.later is not None:
            self.later.settle(wait)

    # -- findings --------------------------------------------------------------------------------

    def report(self, f: Finding, rec: np.void | None = None) -> bool:
        """Report a finding once per (kind, block), with the block's last events and the
        allocation site of `rec` (the block's record as the finding saw it; default: now).

        The kinds the C core reports itself are counted once in the core, whoever finds them
        (its `first_report`); the finding is written into the ring by the core
        (`KVPool.report`)."""
        key = (f.kind, -1 if f.block is None else f.block, f.request if f.block is None else "")
        first = self.pool.core.first_report(f.kind, key[1])
        if first is None:
            first = key not in self.reported
            self.reported.add(key)
        if not first:
            return False
        view = self.pool.view
        if f.block is not None and 0 <= f.block < len(view.blocks):
            f.events = f.events or events_for_block(view, f.block, 8)
            site_id = int((view.blocks[f.block] if rec is None else rec)["site"])
            site = site_text(view, site_id)
            if site:
                f.extra.setdefault("site", site)
                if f.site_id < 0:
                    f.site_id = site_id
        self.pool.report(f)  # (the core records its FINDING event too)
        return True

    def block_finding(self, kind: str, block: int, message: str) -> Finding | None:
        """Report a finding about one block; owner, request and site from its record now."""
        r = self.pool.view.blocks[block].copy()
        req = bytes(r["request"]).decode(errors="replace") or None
        f = Finding(
            kind, message, block=int(block), owner_pid=int(r["owner_pid"]) or None, request=req
        )
        return f if self.report(f, rec=r) else None

    # -- magic -----------------------------------------------------------------------------------

    def verify_often(self) -> None:
        """The header (and conservation) from between operations (stats(), a block table), at
        most every 10 ms (csrc/core.h VERIFY_EVERY_NS, a step's cadence): the core's own check on the core's clock
        (the one its operations keep: one check per interval), which reports what it finds
        itself."""
        self.pool.core.verify_often(self.pool)
        self.pool.deliver_findings()

    def verify(self) -> list[Finding]:
        """pool.verify(): the core's check at once (csrc/entry.c N_verify: the header against
        the bytes seen at attach and its checksum; with the leaks probe, block conservation; in
        guard mode, a CPU pool's canaries), which reports what it finds itself; a CUDA pool's
        canaries scanned here. The findings reported in this call; none from inside a
        callback of one (no recursion)."""
        self.settle(wait=True)
        return self._once(self._verify)

    def scan_canaries(self) -> list[Finding]:
        """Guard mode: every block's guard slot, where the core does not map the K/V (a CUDA
        pool's: pool.verify(); the core scans a CPU pool's itself); findings reported."""
        if not self.flags.guard:
            return []
        bad = [
            blk
            for blk in integrity.broken_canaries(self.pool.kv)
            if self.block_finding(FindingKind.GUARD_VIOLATION, blk, integrity.CANARY_MESSAGE)
        ]
        return [
            Finding(FindingKind.GUARD_VIOLATION, integrity.CANARY_MESSAGE, block=b) for b in bad
        ]

    def _once(self, fn) -> list[Finding]:
        if self.verifying:
            return []
        self.verifying = True
        try:
            return fn()
        finally:
            self.verifying = False

    def _verify(self) -> list[Finding]:
        pool = self.pool
        at, scanned = pool.core.verify(pool)
        found = ring_findings(pool.view, at)
        pool.deliver_findings()
        return found if scanned else found + self.scan_canaries()


def ring_findings(view, positions: list[int]) -> list[Finding]:
    """The findings at these positions of the segment's ring (those the C core wrote in a
    call: KVPool._found) as the probe reports its own: with the block's allocation site and
    its last events before the finding (a header_corrupt: the pool's last events); one
    overwritten since is left out."""
    head = int(view.h["findings_head"])
    out = []
    for k in positions:
        if head - k > FINDINGS_CAPACITY:
            continue
        f = finding_at(view, k)
        at = f.extra.pop("time_ns")
        if f.kind == FindingKind.HEADER_CORRUPT:
            f.events = _events_before(view, at)
            f.extra.update(_header_change(f.message))
        elif f.kind == FindingKind.LOCK_DEAD_HOLDER:
            # the lock, as its message names it (csrc/recovery.c)
            f.extra["lock"] = lock_named(f.message)
        elif f.block is not None:
            f.events = _events_before(view, at, f.block)
            site = site_text(view, f.site_id) if f.site_id >= 0 else None
            if site:
                f.extra["site"] = site
        out.append(f)
    return out


def _events_before(view, at_ns: int, block: int | None = None) -> list[dict]:
    """The last 8 events before a finding the C core wrote at at_ns (of one block, or of the
    pool), its own FINDING event, recorded just before it, left out: what the probe lists when
    it reports."""
    ev = view.events.reshape(-1)
    later = ev["time_ns"] >= at_ns
    if block is None:
        got = recent_events(view, 9 + int(later.sum()))
    else:
        later &= ev["block"] == block
        got = events_for_block(view, block, 9 + int(later.sum()))
    got = [e for e in got if e["time_ns"] < at_ns]
    if got and got[-1]["op"] == "finding":
        got.pop()
    return got[-8:]


_HEADER_CHANGE = re.compile(
    r"changed at byte (-?\d+) \((\w+|\?)\): found (\w+|\?), expected (\w+|\?)"
)


def _header_change(message: str) -> dict:
    """What a header_corrupt's message (csrc/probes.c header_changed) names: the first byte
    that differs, its field, 8 bytes found and expected from there (-1, "?": only the checksum
    differs)."""
    m = _HEADER_CHANGE.search(message)
    if m is None:
        return {}
    return {"offset": int(m[1]), "field": m[2], "found": m[3], "expected": m[4]}
