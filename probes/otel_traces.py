"""Request spans: one `kvscope.request` span per sequence, with its block events.

spans = RequestSpans(tracer)     # KVPoolInstrumentor calls after_<op> after each pool op
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Link, Span, Tracer

from kvscope.probes.otel_metrics import DEVICE, POOL

REQUEST = "kvscope.request.id"


class RequestSpans:
    """Open request spans by sequence; each `after_<op>` adds what the op did to its span."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.spans: dict[Any, Span] = {}
        self.preempted: set[Any] = set()

    def end_all(self) -> None:
        """End every open span (outcome `open`): instrumentation is being removed."""
        for span in self.spans.values():
            span.set_attribute("kvscope.request.outcome", "open")
            span.end()
        self.spans.clear()
        self.preempted.clear()

    def start(self, pool: Any, seq: Any, start_ns: int, links: list[Link] | None = None) -> Span:
        span = self.tracer.start_span(
            "kvscope.request",
            start_time=start_ns,
            links=links,
            attributes={POOL: pool.name, DEVICE: pool.config.device, REQUEST: seq.request_id},
        )
        self.spans[seq] = span
        return span

    def after_allocate(self, pool: Any, args: tuple, seq: Any, start_ns: int) -> None:
        span = self.start(pool, seq, start_ns)
        span.set_attribute("kvscope.request.prompt_tokens", len(seq.tokens))
        span.set_attribute("kvscope.request.cached_tokens", seq.num_cached_tokens)
        span.add_event(
            "allocate",
            {
                "kvscope.blocks": len(seq.block_table),
                "kvscope.prefix_hit_blocks": seq.num_cached_tokens // pool.block_size,
            },
        )

    def after_fork(self, pool: Any, args: tuple, child: Any, start_ns: int) -> None:
        parent = self.spans.get(args[0])
        links = [Link(parent.get_span_context())] if parent is not None else None
        span = self.start(pool, child, start_ns, links)
        span.add_event(
            "fork",
            {
                "kvscope.blocks": len(child.block_table),
                "kvscope.parent.request.id": args[0].request_id,
            },
        )
        if parent is not None:
            parent.add_event("fork", {"kvscope.child.request.id": child.request_id})

    def after_append(self, pool: Any, args: tuple, copies: Any, start_ns: int) -> None:
        seq, span = args[0], self.spans.get(args[0])
        if span is None:
            return
        # One event per block-table change, not per token.
        grew = -(-len(seq.tokens) // pool.block_size) != -(
            -(len(seq.tokens) - len(args[1])) // pool.block_size
        )
        if grew or copies:
            span.add_event(
                "append",
                {"kvscope.blocks": len(seq.block_table), "kvscope.cow_copies": len(copies)},
            )

    def after_resume(self, pool: Any, args: tuple, cached: Any, start_ns: int) -> None:
        # (running again: its next preemption is an event of its own, whatever comes between)
        self.preempted.discard(args[0])
        if (span := self.spans.get(args[0])) is not None:
            span.add_event(
                "resume",
                {"kvscope.blocks": len(args[0].block_table), "kvscope.cached_tokens": cached},
            )

    def after_mark_computed(self, pool: Any, args: tuple, n: Any, start_ns: int) -> None:
        if n and (span := self.spans.get(args[0])) is not None:
            span.add_event("publish", {"kvscope.blocks": n})

    def after_mark_computed_many(self, pool: Any, args: tuple, ns: Any, start_ns: int) -> None:
        # (each sequence's publication, as its own mark_computed's)
        for seq, n in zip(args[0], ns, strict=True):
            self.after_mark_computed(pool, (seq,), n, start_ns)

    def after_free(
        self, pool: Any, args: tuple, result: Any, start_ns: int, outcome: str = "finished"
    ) -> None:
        span = self.spans.pop(args[0], None)
        self.preempted.discard(args[0])
        if span is not None:
            span.add_event("free" if outcome == "finished" else "abort")
            span.set_attribute("kvscope.request.tokens", len(args[0].tokens))
            span.set_attribute("kvscope.request.outcome", outcome)
            span.end()

    def after_abort(self, pool: Any, args: tuple, result: Any, start_ns: int) -> None:
        self.after_free(pool, args, result, start_ns, "aborted")

    def mark_preempted(self, pool: Any) -> None:
        for seq, span in self.spans.items():
            if seq.state == "preempted" and seq not in self.preempted:
                span.add_event("preempt")
                self.preempted.add(seq)
            elif seq.state != "preempted":
                self.preempted.discard(seq)

    def finding_event(self, pool: Any, f: Any) -> None:
        span = next(
            (s for q, s in self.spans.items() if f.request and q.request_id[:32] == f.request),
            None,
        )
        span = span or trace.get_current_span()
        if span.is_recording():
            span.add_event(
                "kvscope.finding",
                {
                    "kvscope.finding.kind": f.kind,
                    "kvscope.finding.severity": f.severity,
                    "kvscope.block.id": -1 if f.block is None else f.block,
                    "message": f.message,
                },
            )
