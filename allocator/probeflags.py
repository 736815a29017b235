"""Which probes a process runs on a pool: the KVSCOPE_* switches `kvscope run` sets (or a
program sets itself) and the pool header's flags (docs/PROBES.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvscope.allocator.layout import Flag

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
