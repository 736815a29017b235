"""Which probes a process runs on a pool: the KVSCOPE_* switches `kvscope run` sets (or a
program sets itself) and the pool header's flags (docs/PROBES.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvscope.allocator.errors import PoolError

GUARD_SAMPLE_ENV = "KVSCOPE_GUARD_SAMPLE"


def guard_sample_from_env(environ=os.environ) -> int:
    """KVSCOPE_GUARD_SAMPLE=N: guard mode guards one allocation in N (0 when unset or not a
    number)."""
    try:
        return max(0, int(environ.get(GUARD_SAMPLE_ENV, "0") or 0))
    except ValueError:
        return 0


PROVENANCE_SAMPLE_ENV = "KVSCOPE_PROVENANCE_SAMPLE"


def provenance_sample_from_env(environ=os.environ) -> int:
    """KVSCOPE_PROVENANCE_SAMPLE=N: slot provenance records one sequence in N (0, unset or not a
    number: off; docs/POOL.md "Slot provenance")."""
    try:
        return max(0, int(environ.get(PROVENANCE_SAMPLE_ENV, "0") or 0))
    except ValueError:
        return 0


# The live checks' thresholds, in seconds (0 turns the check off): a request holding blocks
# that its live process has not served for this long is `idle_request` (allocator/idle.py), a
# pool lock held this long is `lock_held_too_long` (allocator/checklocks.py). The creating
# process's values are recorded in the pool's header (header.py threshold_s reads them back),
# so every reader of it (the run's supervisor, `kvscope check`, `top` and the metrics in
# another shell) says the same. (No numpy here: `kvscope run` checks them before the script
# starts.)
IDLE_REQUEST_ENV = "KVSCOPE_IDLE_REQUEST_S"
DEFAULT_IDLE_REQUEST_S = 30.0
LOCK_HOLD_ENV = "KVSCOPE_LOCK_HOLD_S"
DEFAULT_LOCK_HOLD_S = 1.0
# variable -> (its header field, in ms, and its default)
THRESHOLDS = {
    IDLE_REQUEST_ENV: ("idle_request_ms", DEFAULT_IDLE_REQUEST_S),
    LOCK_HOLD_ENV: ("lock_hold_ms", DEFAULT_LOCK_HOLD_S),
}
# (the header keeps milliseconds in a u4: about 49 days)
MAX_THRESHOLD_S = (2**32 - 1) // 1000


def env_seconds(name: str, environ=os.environ) -> float | None:
    """The seconds a threshold variable sets (0: off); None where it is unset or empty. A
    PoolError, naming the variable, where it is not a number of seconds >= 0."""
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= MAX_THRESHOLD_S:  # (NaN too)
        raise PoolError(
            f"{name} must be a number of seconds from 0 (off) to {MAX_THRESHOLD_S:,}, got {text!r}"
        )
    return value


def threshold_ms(name: str, environ=os.environ) -> int:
    """The header's record of a threshold variable in this process (at a pool's creation):
    its value in ms, at least 1 where it is on; the default where unset."""
    value = env_seconds(name, environ)
    seconds = THRESHOLDS[name][1] if value is None else value
    return max(1, round(seconds * 1000)) if seconds > 0 else 0


def env_flag(name: str, environ=os.environ) -> bool:
    """A probe switch: KVSCOPE_<NAME>=1/0; unset means on under `kvscope run`, off otherwise."""
    value = environ.get(f"KVSCOPE_{name}")
    if value is None:
        return bool(environ.get("KVSCOPE_RUN_DIR"))
    return value not in ("0", "", "false", "no", "off")


@dataclass
class ProbeFlags:
    """Which probes a process runs on a pool."""

    events: bool = False
    ownership: bool = False
    guard: bool = False
    leaks: bool = False
    magic: bool = False
    digest: bool = False

    @classmethod
    def from_env(cls, header_flags: int, environ=os.environ) -> ProbeFlags:
        """Probes switched on by the environment or recorded in the pool's header."""
        from kvscope.allocator.layout import Flag

        return cls(
            events=env_flag("EVENTS", environ) or bool(header_flags & Flag.EVENTS),
            ownership=env_flag("OWNERSHIP", environ),
            guard=bool(header_flags & Flag.GUARD),
            leaks=env_flag("LEAKS", environ),
            magic=env_flag("MAGIC", environ),
            digest=env_flag("DIGEST", environ),
        )

    def any(self) -> bool:
        return (
            self.events or self.ownership or self.guard or self.leaks or self.magic or self.digest
        )
