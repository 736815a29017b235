"""Pool-level metrics: one collector reads every pool's segment in observable-instrument callbacks.

A pool shared by several processes keeps its counters in the segment, so the one process that
runs the collector (under `kvscope run`: the supervisor) reports each pool exactly once:

    collector = PoolCollector(meter, lambda: ["demo"], logger=logger)
    ...
    collector.close()
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from kvscope.allocator.findings import SEVERITY as KIND_SEVERITY
from kvscope.allocator.layout import FINDINGS_CAPACITY, BlockState, SegmentView
from kvscope.allocator.segment import MappedFile, open_existing, release, segment_path, view_of
from kvscope.allocator.stats import pool_stats
from kvscope.probes.nvml import INDEX as GPU_INDEX
from kvscope.probes.nvml import nvml_index

POOL = "kvscope.pool.name"
DEVICE = "kvscope.pool.device"
STATE = "kvscope.block.state"
LOCK = "kvscope.lock.name"
KIND = "kvscope.finding.kind"
SEVERITY = "kvscope.finding.severity"
# A finding that scrolled out of the segment's findings ring before the collector read it.
OVERFLOW_KIND = "overflow"
STATE_NAMES = {s: s.name.lower() for s in BlockState}


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric: name, instrument kind, UCUM unit, meaning and attribute keys."""

    name: str
    kind: str
    unit: str
    description: str
    attributes: tuple[str, ...] = (POOL, DEVICE)


# (name, stats key) of the monotonic segment counters, reported as observable counters.
COUNTERS = (
    ("kvscope.pool.allocations", "num_allocs", "{block}", "Blocks handed out by allocations."),
    (
        "kvscope.pool.frees",
        "num_frees",
        "{block}",
        "Block references dropped by free/abort/preempt.",
    ),
    ("kvscope.pool.cow_copies", "num_cow", "{block}", "Copy-on-write block copies."),
    ("kvscope.pool.evictions", "num_evictions", "{block}", "Cached blocks evicted for reuse."),
    ("kvscope.pool.preemptions", "num_preemptions", "{sequence}", "Waiting sequences preempted."),
    (
        "kvscope.pool.prefix.queries",
        "prefix_queries",
        "{block}",
        "Full prompt blocks looked up in the prefix index.",
    ),
    (
        "kvscope.pool.prefix.hits",
        "prefix_hits",
        "{block}",
        "Prompt blocks served from the prefix index.",
    ),
    ("kvscope.pool.forks", "num_forks", "{sequence}", "Sequences forked (all blocks shared)."),
    (
        "kvscope.pool.exhausted",
        "num_exhausted",
        "{error}",
        "PoolExhausted raised: takes that found no block left.",
    ),
)
# (name, stats key, unit, description) of the pool gauges without extra attributes.
GAUGES = (
    ("kvscope.pool.utilization", "utilization", "1", "Fraction of blocks allocated to sequences."),
    (
        "kvscope.pool.internal_fragmentation",
        "internal_fragmentation",
        "1",
        "Fraction of slots in allocated blocks holding no token.",
    ),
    (
        "kvscope.pool.refcount.peak",
        "refcount_peak",
        "{reference}",
        "Highest reference count of any block now.",
    ),
    (
        "kvscope.pool.prefix.hit_rate",
        "prefix_hit_rate",
        "1",
        "Prefix hits / prefix queries since the pool was created.",
    ),
    (
        "kvscope.pool.sequences",
        "num_sequences",
        "{sequence}",
        "Live sequences in the sequence table.",
    ),
    (
        "kvscope.pool.requests.idle",
        "idle_requests",
        "{request}",
        "Running requests holding blocks that their process has not served for"
        " KVSCOPE_IDLE_REQUEST_S seconds (idle_request).",
    ),
    (
        "kvscope.pool.requests.max_idle",
        "max_idle_s",
        "s",
        "The longest any running request holding blocks has gone unserved by its process.",
    ),
)
POOL_METRICS = (
    [MetricSpec(n, "counter", u, d) for n, _, u, d in COUNTERS]
    + [MetricSpec(n, "gauge", u, d) for n, _, u, d in GAUGES]
    + [
        MetricSpec(
            "kvscope.pool.blocks", "gauge", "{block}", "Blocks by state.", (POOL, DEVICE, STATE)
        ),
        MetricSpec(
            "kvscope.pool.memory.usage",
            "gauge",
            "By",
            "KV data bytes by block state.",
            (POOL, DEVICE, STATE),
        ),
        MetricSpec("kvscope.pool.memory.limit", "gauge", "By", "KV data bytes of the whole pool."),
        MetricSpec(
            "kvscope.pool.findings",
            "counter",
            "{finding}",
            "Findings reported to the pool, by kind.",
            (POOL, DEVICE, KIND, SEVERITY),
        ),
        MetricSpec(
            "kvscope.pool.lock.acquisitions",
            "counter",
            "{acquisition}",
            "Pool lock acquisitions, all processes.",
            (POOL, DEVICE, LOCK),
        ),
        MetricSpec(
            "kvscope.pool.lock.contentions",
            "counter",
            "{acquisition}",
            "Acquisitions that had to wait.",
            (POOL, DEVICE, LOCK),
        ),
        MetricSpec(
            "kvscope.pool.lock.wait_time",
            "counter",
            "s",
            "Time spent waiting for pool locks, all processes.",
            (POOL, DEVICE, LOCK),
        ),
        MetricSpec(
            "kvscope.pool.lock.hold_time",
            "counter",
            "s",
            "Time pool locks were held, all processes.",
            (POOL, DEVICE, LOCK),
        ),
    ]
)


def pool_attributes(name: str, device: str) -> dict[str, Any]:
    """The attributes of every series of one pool: its name and device and, for a pool on a GPU,
    that GPU's NVML index, which the GPU's own `hw.gpu.*` series carry too (one pool per GPU:
    each rank's pool beside its GPU's memory)."""
    attrs: dict[str, Any] = {POOL: name, DEVICE: device}
    if device.startswith("cuda"):
        attrs[GPU_INDEX] = nvml_index(device)
    return attrs


class _Reader:
    """One mapped segment, reopened when its file is replaced and dropped when it is gone."""

    def __init__(self, name: str, path: str):
        self.name = name
        self.path = path
        self.ino = os.stat(self.path).st_ino
        self.mf: MappedFile = open_existing(self.path, name)
        self.view: SegmentView = view_of(self.mf)
        h = self.view.h
        self.attrs = pool_attributes(name, bytes(h["device"]).decode())
        self.block_bytes = int(h["data_bytes"]) // max(1, int(h["num_blocks"]))
        self.findings_seen = 0
        # Every kind of the pool at 0 from the first read (at its default severity): a rate or
        # an increase over the counter sees the first finding of a kind, which it would not
        # were the series to begin at 1.
        self.kind_counts: dict[tuple[str, str], int] = {
            (str(k.value), sev): 0
            for k, sev in KIND_SEVERITY.items()
            if not k.value.startswith("kv_event_")
        }
        # The findings emitted, by kvscope.allocator.findingset.finding_key.
        self.emitted: set[tuple[str, int | None, int | None]] = set()

    def stale(self) -> bool:
        try:
            return os.stat(self.path).st_ino != self.ino
        except FileNotFoundError:
            return True

    def close(self) -> None:
        self.view = None  # type: ignore[assignment]
        release(self.mf)


class PoolCollector:
    """Registers the pool-level instruments on `meter`; each callback reads the segments."""

    def __init__(
        self,
        meter: Meter,
        pool_names: Callable[[], Iterable[str]],
        logger: Any = None,
        max_age_s: float = 0.1,
        path_of: Callable[[str], str] = segment_path,
    ):
        """Args:
        path_of: the segment file of a pool by name (`kvscope run`: where the script's
            unlink renamed it, so that the last export still reads it).
        """
        self.pool_names = pool_names
        self.path_of = path_of
        self.logger = logger
        self.max_age_s = max_age_s
        # Callbacks of a forked child (inherited provider) report nothing: the parent collects.
        self.pid = os.getpid()
        self._mutex = threading.Lock()
        self._readers: dict[str, _Reader] = {}
        self._stats: list[tuple[_Reader, dict[str, Any]]] = []
        self._read_at = 0.0
        self._closed = False
        self._finished = False
        for spec in POOL_METRICS:
            make = (
                meter.create_observable_counter
                if spec.kind == "counter"
                else meter.create_observable_gauge
            )
            make(
                spec.name,
                callbacks=[self._callback(spec.name)],
                unit=spec.unit,
                description=spec.description,
            )

    def refresh(self, max_age_s: float = 0.0) -> list[tuple[_Reader, dict[str, Any]]]:
        """Read every pool's stats (reused when younger than max_age_s); emit new findings."""
        with self._mutex:
            if self._closed or os.getpid() != self.pid:
                return []
            if time.monotonic() - self._read_at <= max_age_s and self._read_at:
                return self._stats
            self._sync_readers()
            out = []
            for r in self._readers.values():
                try:
                    stats = pool_stats(r.view, now_mono_ns=time.monotonic_ns())
                except (ValueError, IndexError):
                    # A torn read of a segment being rewritten: skip it this round.
                    continue
                self._read_findings(r)
                out.append((r, stats))
            self._stats, self._read_at = out, time.monotonic()
            return out

    def _sync_readers(self) -> None:
        names = set(self.pool_names())
        for name in list(self._readers):
            r = self._readers[name]
            if name not in names or r.path != self.path_of(name) or r.stale():
                self._readers.pop(name).close()
        for name in names - set(self._readers):
            try:
                self._readers[name] = _Reader(name, self.path_of(name))
            except Exception:  # noqa: BLE001 - a pool that vanished or is not valid yet
                continue

    def _read_findings(self, r: _Reader) -> None:
        """Count findings written since the last read by kind; emit each as a log record."""
        from kvscope.allocator.findings import read_findings

        head = int(r.view.h["findings_head"])
        new = head - r.findings_seen
        if new <= 0:
            return
        lost = max(0, new - FINDINGS_CAPACITY)
        if lost:
            key = (OVERFLOW_KIND, "warning")
            r.kind_counts[key] = r.kind_counts.get(key, 0) + lost
        for f in read_findings(r.view)[-(new - lost) :]:
            self._emit(r, f)
        r.findings_seen = head

    def _emit(self, r: _Reader, f: Any) -> None:
        from kvscope.allocator.findingset import finding_key

        key = (f.kind, f.severity)
        r.kind_counts[key] = r.kind_counts.get(key, 0) + 1
        r.emitted.add(finding_key(f))
        if self.logger is not None:
            emit_finding_log(self.logger, f, r.attrs)

    def _last_findings(self, r: _Reader) -> None:
        """At the end: the pool's findings as every reader assembles them (the whole-pool
        check, the KV data's checks, its data file), those the ring did not already give."""
        from kvscope.allocator.findingset import Origin, finding_key, pool_findings
        from kvscope.allocator.snapshot import snapshot

        try:
            origin = Origin.live(r.name, data_file=r.path + ".data")
            found = pool_findings(snapshot(r.view), origin).findings
        except (ValueError, IndexError, OSError):
            return  # a segment being rewritten or removed meanwhile
        for f in found:
            if finding_key(f) not in r.emitted:
                self._emit(r, f)

    def _callback(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            out: list[Observation] = []
            for r, stats in self.refresh(self.max_age_s):
                out += observations(name, r, stats)
            return out

        return observe

    def finish(self) -> None:
        """Read the segments one last time, emitting late findings and those only the whole
        assembly finds: before the last export, so that it carries them (once)."""
        self.refresh()
        with self._mutex:
            if self._finished or self._closed or os.getpid() != self.pid:
                return
            self._finished = True
            for r in self._readers.values():
                self._last_findings(r)
        # The findings just emitted, in the counts the last export reads.
        self._read_at = 0.0

    def close(self) -> None:
        """finish() if not done, and unmap the segments."""
        self.finish()
        with self._mutex:
            self._closed = True
            for r in self._readers.values():
                r.close()
            self._readers.clear()
            self._stats = []


def observations(name: str, r: _Reader, stats: dict[str, Any]) -> list[Observation]:
    """The data points of metric `name` for one pool."""
    a = r.attrs
    for metric, key, _, _ in COUNTERS + GAUGES:
        if metric == name:
            return [Observation(stats[key], a)]
    by_state = {s: stats[f"num_{n}"] for s, n in STATE_NAMES.items()}
    if name == "kvscope.pool.blocks":
        return [Observation(v, {**a, STATE: STATE_NAMES[s]}) for s, v in by_state.items()]
    if name == "kvscope.pool.memory.usage":
        return [
            Observation(v * r.block_bytes, {**a, STATE: STATE_NAMES[s]})
            for s, v in by_state.items()
        ]
    if name == "kvscope.pool.memory.limit":
        return [Observation(stats["num_blocks"] * r.block_bytes, a)]
    if name == "kvscope.pool.findings":
        return [Observation(n, {**a, KIND: k, SEVERITY: s}) for (k, s), n in r.kind_counts.items()]
    locks = r.view.locks
    names = [bytes(x).decode() for x in locks["name"]]
    field, scale = {
        "kvscope.pool.lock.acquisitions": ("num_acquires", 1),
        "kvscope.pool.lock.contentions": ("num_contended", 1),
        "kvscope.pool.lock.wait_time": ("wait_ns", 1e-9),
        "kvscope.pool.lock.hold_time": ("hold_ns", 1e-9),
    }[name]
    values = locks[field]
    return [Observation(int(values[i]) * scale, {**a, LOCK: n}) for i, n in enumerate(names) if n]


def emit_finding_log(logger: Any, f: Any, attrs: dict[str, str]) -> None:
    """One OpenTelemetry log record for a finding (severity ERROR or WARN)."""
    from opentelemetry._logs import SeverityNumber

    err = f.severity == "error"
    extra = {
        k: v
        for k, v in (
            ("kvscope.block.id", f.block),
            ("kvscope.owner.pid", f.owner_pid),
            ("kvscope.request.id", f.request),
        )
        if v is not None
    }
    logger.emit(
        severity_number=SeverityNumber.ERROR if err else SeverityNumber.WARN,
        severity_text="ERROR" if err else "WARN",
        body=f.message,
        event_name="kvscope.finding",
        attributes={**attrs, KIND: f.kind, SEVERITY: f.severity, **extra},
    )
