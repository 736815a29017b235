"""What a run measured: per-request results, per-step samples, and the summary built from them.

Definitions (also in `--json`):
- KV utilization: tokens stored / slots reserved, averaged over the run weighted by step time
  (a block shared by several sequences counts once).
- internal fragmentation: slots a request held at its end but never filled / slots held, over
  all requests (the unfilled tail of the last block when paged; `max_len` minus the final
  length in the static layout).
- prompt tokens cached: prompt tokens found in the pool's prefix index at admission / prompt tokens.
- peak concurrent requests: most requests with a sequence in the running batch at once.
- preemptions: times the pool took a waiting sequence's blocks and it had to be recomputed.
- peak KV blocks: most blocks the running and waiting sequences' tables held at once (a block
  shared by several sequences counts once; cached blocks no table maps are not held).
- time to first token from admission: first token minus the step that admitted the request,
  leaving out the time it queued (what a closed-loop client of a full server sees on top).
  For a scoring request, its scores take the first token's place.
- scored tokens: continuation tokens of scoring requests whose log-likelihoods were returned.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestResult:
    """One request's outputs and timeline, times in seconds since the run started."""

    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    outputs: list[list[int]] = field(default_factory=list)
    num_hit_tokens: int = 0
    admitted_s: float = -1.0
    first_token_s: float = -1.0
    finish_s: float = -1.0
    reserved_slots: int = 0
    stored_tokens: int = 0
    error: str = ""
    cancelled: bool = False
    worker: int = 0
    # a scoring request: each continuation token's log-probability given the tokens before it,
    # and whether greedy decoding would have produced the whole continuation
    logprobs: list[float] = field(default_factory=list)
    is_greedy: bool = False

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated over all samples."""
        return sum(len(o) for o in self.outputs)


@dataclass
class StepSample:
    """The cache after one engine step: how many tokens it stores in how many reserved slots."""

    t_s: float
    dt_s: float
    stored_tokens: int
    reserved_slots: int
    num_tokens: int
    # requests with a stream in the running batch after this step
    num_running_requests: int = 0
    worker: int = 0
    # distinct blocks in the running and waiting sequences' tables
    held_blocks: int = 0
    # the same tables' blocks counted once per table: what they would hold if none were shared
    mapped_blocks: int = 0


@dataclass
class Summary:
    """The numbers of the summary table."""

    baseline: str
    workers: int
    requests: int
    cancelled: int
    failed: int
    output_tokens: int
    duration_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    kv_utilization: float
    internal_fragmentation: float
    peak_concurrent_requests: int
    prefix_hit_rate: float
    preemptions: int
    # KV memory: slots reserved per running request, time-weighted (shared blocks count once)
    kv_slots_per_request: float = 0.0
    peak_kv_blocks: int = 0
    ttft_admitted_p50_ms: float = 0.0
    ttft_admitted_p95_ms: float = 0.0
    scored_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        """One JSON object."""
        return json.dumps(asdict(self), indent=2, sort_keys=True)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def peak_running(samples: list[StepSample]) -> int:
    """Most requests running at once over all workers (each worker's latest sample counts)."""
    return peak_over_workers(samples, "num_running_requests")


def peak_over_workers(samples: list[StepSample], field_name: str) -> int:
    """The largest sum over workers of a sample field (each worker's latest sample counts)."""
    current: dict[int, int] = {}
    peak = 0
    for sample in sorted(samples, key=lambda s: s.t_s):
        current[sample.worker] = getattr(sample, field_name)
        peak = max(peak, sum(current.values()))
    return peak


def summarize(
    results: list[RequestResult],
    samples: list[StepSample],
    duration_s: float,
    num_preemptions: int,
    baseline: str = "paged",
    workers: int = 1,
    extra: dict[str, Any] | None = None,
) -> Summary:
    """The summary of a run from every worker's results and samples."""
    done = [r for r in results if not r.error]
    ttfts = [(r.first_token_s - r.arrival_s) * 1000.0 for r in done if r.first_token_s >= 0]
    admitted = [
        (r.first_token_s - r.admitted_s) * 1000.0
        for r in done
        if r.first_token_s >= 0 and r.admitted_s >= 0
    ]
    output_tokens = sum(r.num_output_tokens for r in done)
    stored = sum(s.stored_tokens * s.dt_s for s in samples)
    reserved = sum(s.reserved_slots * s.dt_s for s in samples)
    held = sum(r.reserved_slots for r in done)
    unfilled = sum(r.reserved_slots - r.stored_tokens for r in done)
    prompt_tokens = sum(r.num_prompt_tokens for r in done)
    return Summary(
        baseline=baseline,
        workers=workers,
        requests=sum(not r.cancelled for r in done),
        cancelled=sum(r.cancelled for r in done),
        failed=len(results) - len(done),
        output_tokens=output_tokens,
        duration_s=round(duration_s, 3),
        output_tokens_per_s=round(output_tokens / duration_s, 1) if duration_s > 0 else 0.0,
        ttft_p50_ms=round(percentile(ttfts, 50), 1),
        ttft_p95_ms=round(percentile(ttfts, 95), 1),
        kv_utilization=round(stored / reserved, 3) if reserved else 0.0,
        internal_fragmentation=round(unfilled / held, 3) if held else 0.0,
        peak_concurrent_requests=peak_running(samples),
        prefix_hit_rate=round(sum(r.num_hit_tokens for r in done) / prompt_tokens, 3)
        if prompt_tokens
        else 0.0,
        preemptions=num_preemptions,
        kv_slots_per_request=slots_per_request(samples),
        peak_kv_blocks=peak_over_workers(samples, "held_blocks"),
        ttft_admitted_p50_ms=round(percentile(admitted, 50), 1),
        ttft_admitted_p95_ms=round(percentile(admitted, 95), 1),
        scored_tokens=sum(len(r.logprobs) for r in done),
        extra=extra or {},
    )


def slots_per_request(samples: list[StepSample]) -> float:
    """KV slots reserved per running request, weighted by step time (memory per request)."""
    busy = [s for s in samples if s.num_running_requests > 0]
    weight = sum(s.dt_s for s in busy)
    if weight <= 0:
        return 0.0
    total = sum(s.reserved_slots / s.num_running_requests * s.dt_s for s in busy)
    return round(total / weight, 1)


ROWS = [
    ("requests", "requests", "{}"),
    ("cancelled by the client", "cancelled", "{}"),
    ("failed", "failed", "{}"),
    ("output tokens", "output_tokens", "{}"),
    ("duration", "duration_s", "{:.2f} s"),
    ("output tokens/s", "output_tokens_per_s", "{:.1f}"),
    ("time to first token p50", "ttft_p50_ms", "{:.1f} ms"),
    ("time to first token p95", "ttft_p95_ms", "{:.1f} ms"),
    ("KV utilization", "kv_utilization", "{:.1%}"),
    ("internal fragmentation", "internal_fragmentation", "{:.1%}"),
    ("peak concurrent requests", "peak_concurrent_requests", "{}"),
    ("KV slots per running request", "kv_slots_per_request", "{:.0f}"),
    ("prompt tokens cached", "prefix_hit_rate", "{:.1%}"),
    ("preemptions", "preemptions", "{}"),
]


def render_table(summary: Summary) -> Any:
    """A rich Table of the summary."""
    from rich.table import Table

    title = f"serve.py — {summary.baseline} cache, {summary.workers} worker(s)"
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, key, fmt in ROWS:
        table.add_row(label, fmt.format(getattr(summary, key)))
    return table
