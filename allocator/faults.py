"""Named, reproducible fault injection: `KVSCOPE_INJECT=<fault>[:<n>][,<fault>...]`.

Each fault makes the allocator misbehave once, at the n-th opportunity (default 3, so it strikes
in the middle of real work), in a way a real bug would; the probes must then report it. Tests
and users use them to prove their detection works. See docs/PROBES.md for what each one does.
"""

from __future__ import annotations

import os
import sys

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
)
DEFAULT_AT = 3

# fault -> opportunities left before it fires; empty when nothing is armed (the common case).
ARMED: dict[str, int] = {}


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


def fire(name: str) -> bool:
    """True exactly once: at the armed fault's n-th opportunity."""
    left = ARMED.get(name)
    if left is None:
        return False
    if left > 1:
        ARMED[name] = left - 1
        return False
    del ARMED[name]
    print(f"kvscope: injecting fault {name!r} (pid {os.getpid()})", file=sys.stderr, flush=True)
    return True


def _from_env() -> None:
    try:
        configure(os.environ.get("KVSCOPE_INJECT"))
    except ValueError as e:
        print(f"kvscope: KVSCOPE_INJECT ignored: {e}", file=sys.stderr)


_from_env()
