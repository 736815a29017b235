"""Named, reproducible fault injection: `KVSCOPE_INJECT=<fault>[:<n>][,<fault>...]`.

Each fault makes the allocator misbehave once, at the n-th opportunity (default 3, so it strikes
in the middle of real work), in a way a real bug would; the probes must then report it. Tests
and users use them to prove their detection works. See docs/PROBES.md for what each one does.

The sites are the C core's operations (csrc/faults.c): at each opportunity a site counts the
fault's entry of `ARMED` down; from the n-th opportunity on the fault stays due until the site
has acted and called `fired(name)`, so a site that cannot act this time (a double free needs a
block that was really freed) acts at the next one it can. Only `fired` announces the fault: a
fault that says it was injected was injected. Faults still armed when a process exits are
listed by `unfired()` (`kvscope run` reports them). One fault strikes outside the pool, where
the bug it plants lives: `stale-padding-row` in the example engine's padded block table
(examples/server/graphs.py), counted by `opportunity` the same way.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvscope.allocator.handle import PoolHandle

FAULTS = (
    "double-free",
    "leak",
    "oob-write",
    "header-scribble",
    "block-scribble",
    "use-after-free",
    "refcount-skew",
    "kill-holding-lock",
    "lock-inversion",
    "stale-padding-row",
    "gil-wait",
    "transfer-after-free",
    "lease-leak",
    "foreign-slot",
)
DEFAULT_AT = 3

# The finding kinds each fault is found as (docs/PROBES.md's table of faults), and where a
# probe meets it later than the fault strikes, or only under a condition, what finds it:
# `kvscope run` says so when a fault fired and no finding of its kinds came.
FOUND_AS: dict[str, tuple[tuple[str, ...], str]] = {
    "double-free": (("double_free",), ""),
    "leak": (("leak_finished",), "at the process's exit, or when it closes the pool"),
    "oob-write": (
        ("guard_violation",),
        "guard mode (without it the write lands in the next block)",
    ),
    "header-scribble": (("header_corrupt",), ""),
    "block-scribble": (("block_header_corrupt",), ""),
    "use-after-free": (("use_after_free",), ""),
    "refcount-skew": (("refcount_mismatch",), ""),
    "kill-holding-lock": (("lock_dead_holder", "leak_dead_owner"), "a survivor's reclaim"),
    "lock-inversion": (("lock_order_cycle",), "lockdep"),
    "stale-padding-row": (("block_table_mismatch",), "guard mode's audit of the step's table"),
    "gil-wait": (("wait_holds_gil",), "lockdep"),
    "transfer-after-free": (("transfer_after_free",), "the transfer's completion"),
    "lease-leak": (("lease_leak",), "the holder's close(), or expire_leases past its deadline"),
    "foreign-slot": (
        ("foreign_slot",),
        "a later prefix hit on the block, or a sweep of a sequence holding it "
        "(pool.check_provenance)",
    ),
}

# fault -> opportunities left before it fires; empty when nothing is armed (the common case).
ARMED: dict[str, int] = {}
# Faults this process injected, in order.
FIRED: list[str] = []
# Called with the fault's name each time one is injected (kvscope/child.py records it).
ON_FIRE: list[Callable[[str], None]] = []


def parse(spec: str | None) -> dict[str, int]:
    """`leak,oob-write:5` -> {"leak": 3, "oob-write": 5}; ValueError on an unknown name."""
    out: dict[str, int] = {}
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        name, _, n = part.partition(":")
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
        out[name] = int(n) if n else DEFAULT_AT
    return out


def configure(spec: str | None) -> None:
    """Arm the faults of a spec (None or "" disarms all)."""
    ARMED.clear()
    ARMED.update(parse(spec))


def opportunity(name: str) -> bool:
    """A fault's opportunity at a site outside the pool's operations (the example engine's
    padded block table: `stale-padding-row`), counted on `ARMED` as the core counts its own
    (csrc/faults.c fault_opportunity): True at the n-th opportunity and at every later one until
    the site has acted and called `fired`."""
    left = ARMED.get(name)
    if left is None:
        return False
    if left > 1:
        ARMED[name] = left - 1
        return False
    return True


def fired(name: str) -> None:
    """The site has injected the fault: disarm it and announce it."""
    assert ARMED.get(name) == 1, f"fault {name!r} fired without its opportunity"
    del ARMED[name]
    FIRED.append(name)
    print(f"kvscope: injecting fault {name!r} (pid {os.getpid()})", file=sys.stderr, flush=True)
    for hook in ON_FIRE:
        hook(name)


def write_past(pool: PoolHandle, block: int) -> None:
    """oob-write's act (the C core calls it): 1.0 into the slot one past the
    block's last token (its guard slot, or the next block's slot 0), in every layer, K and V."""
    kv = pool.kv
    # [layers, 2, blocks * slots, heads, dim]
    flat = kv.view(kv.shape[0], 2, -1, *kv.shape[4:])
    flat[:, :, block * pool.slots_per_block + pool.block_size] = 1.0


def unfired() -> list[str]:
    """Faults still armed in this process: their site never had an opportunity it could use."""
    return sorted(ARMED)


def _from_env() -> None:
    try:
        configure(os.environ.get("KVSCOPE_INJECT"))
    except ValueError as e:
        print(f"kvscope: KVSCOPE_INJECT ignored: {e}", file=sys.stderr)


_from_env()
