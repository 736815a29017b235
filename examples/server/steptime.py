"""Where an engine step's time goes: host seconds per phase, and the GPU's time per step.

    timer = StepTimer(device)
    gpu = timer.gpu_began(batch)     # CUDA: a timing event before the step's GPU work
    ...
    timer.gpu_ended(gpu)             # after its last kernel (the token pick)
    timer.add((t0, t1, ..., t7))     # perf_counter at each phase boundary
    timer.gpu_seconds()              # {"decode": (steps, s), "mixed": (steps, s)}

On CUDA, "launch" is the time to issue the model's kernels (or replay its graph) and "wait" the
time the host then waits for the sampled tokens: a step whose wait is near zero is bound by its
launches. The GPU's time of a step runs from an event recorded before its input copies to one
after the token pick; against the run's wall time it is the share the GPU spent inside steps
(with graphs nearly its busy time; an eager step's span also holds the gaps while Python issues
kernels).
"""

from __future__ import annotations

from typing import Any

import torch

# A step's phases, in order: admit and plan; pack the batch; issue the forward (or replay its
# graph); queue the token pick and its copy to the host, then publish computed blocks to the pool
# while the GPU runs; wait for the sampled tokens; sample, append and finish in the pool; record
# the cache's fill for the report.
PHASES = ("schedule", "batch", "launch", "publish", "wait", "pool", "record")


class StepTimer:
    """Host seconds per phase summed over the run, and (CUDA) timing events per step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phase_s: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.num_steps = 0
        # (step kind, start event, end event): "decode" or "mixed" (holds prompt chunks)
        self.events: list[tuple[str, Any, Any]] = []

    def add(self, times: tuple[float, ...]) -> None:
        """One step's `perf_counter` readings at the boundaries of its phases."""
        assert len(times) == len(PHASES) + 1
        for phase, start, end in zip(PHASES, times[:-1], times[1:], strict=True):
            self.phase_s[phase] += end - start
        self.num_steps += 1

    def gpu_began(self, mixed: bool) -> Any:
        """Record a timing event before a step's GPU work; its end event (None off CUDA)."""
        if self.device.type != "cuda":
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(self.device))
        self.events.append(("mixed" if mixed else "decode", start, end))
        return end

    def gpu_ended(self, end: Any) -> None:
        if end is not None:
            end.record(torch.cuda.current_stream(self.device))

    def gpu_seconds(self) -> dict[str, tuple[int, float]]:
        """Per step kind: how many steps, and the GPU seconds their work took (CUDA only)."""
        if self.events:
            torch.cuda.synchronize(self.device)
        out: dict[str, tuple[int, float]] = {}
        for kind, start, end in self.events:
            steps, seconds = out.get(kind, (0, 0.0))
            out[kind] = (steps + 1, seconds + start.elapsed_time(end) / 1000.0)
        return out
