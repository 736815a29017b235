"""The serving loop: requests arrive, the scheduler plans a step, the model runs it on the pool.

    engine = Engine(model, pool)
    results = engine.run(requests)

Each step runs prompt chunks and decodes together through the model; attention reads and
writes the pool's KV tensor through `kvscope.kernels`. A finished prompt samples its first
token (and forks `n - 1` siblings that share its blocks until they write: copy-on-write).

Two kinds of request (`workload.Request`):
- generation: the prompt, then `max_tokens` sampled tokens (`RequestResult.outputs`);
- scoring (`continuation` set, as lm-eval-harness's loglikelihood requests): the prompt and the
  continuation are computed as one prompt, in the same steps as everything else, and each
  continuation token's log-probability given the tokens before it is gathered from the logits
  of the position before it (`RequestResult.logprobs`, and `is_greedy`: every continuation
  token was the argmax). Nothing is sampled; the request is done when its last token is.
  Its prefix hits stop before the prompt's last token, so every scored position is computed.
"""

from __future__ import annotations

import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kvscope import kernels

from . import violations
from .batch import Batch, guarded
from .graphs import StepGraphs
from .hostcopy import HostCopy
from .model import LlamaModel
from .offload import Offloader
from .report import RequestResult, StepSample
from .scheduler import Scheduler, Stream
from .static import StaticCache
from .steptime import StepTimer
from .workload import Request


@dataclass
class RequestState:
    """A request in flight: its streams and its result so far."""

    request: Request
    result: RequestResult
    streams: list[Stream] = field(default_factory=list)
    num_finished: int = 0
    forked: bool = False


def sample(logits: Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """Greedy when `temperature <= 0`, else a draw from softmax(logits / temperature)."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class StepClock:
    """Virtual seconds: `step_s` per engine step, jumping over idle gaps to the next arrival.

    With it a run is the same on every machine: which requests have arrived by which step does
    not depend on how fast the steps run (the scenarios and the tests use it; the wall clock,
    `time.monotonic`, is the default).
    """

    def __init__(self, step_s: float = 0.005) -> None:
        self.step_s = step_s
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def tick(self) -> None:
        """One engine step has run."""
        self.t += self.step_s

    def sleep(self, seconds: float) -> None:
        """Idle until `seconds` later (no real waiting)."""
        self.t += seconds


class Engine:
    """Continuous batching over one cache (a `KVPool`, or the static baseline)."""

    def __init__(
        self,
        model: LlamaModel,
        cache: Any,
        *,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 256,
        prefill_chunk: int = 64,
        seed: int = 0,
        exclusive: bool = True,
        worker: int = 0,
        prefix_cache: bool = True,
        clock: Callable[[], float] = time.monotonic,
        graphs: StepGraphs | None = None,
    ) -> None:
        self.model = model
        # steps replayed as CUDA graphs (None: every step runs eagerly)
        self.graphs = graphs
        self.cache = cache
        self.device = model.lm_head.weight.device
        self.seed = seed
        # exclusive: no other process allocates from this cache, so a stall is final
        self.exclusive = exclusive
        self.worker = worker
        # False: never publish computed blocks (the "prefix caching off" baseline)
        self.prefix_cache = prefix_cache
        self.clock = clock
        self.start_s = clock()
        # the static layout reserves everything at admission: no headroom to keep
        watermark = 0.0 if isinstance(cache, StaticCache) else 1.0
        # a new stream waits for the prefix a running one computes (only where blocks are published)
        defer = prefix_cache and not isinstance(cache, StaticCache)
        self.scheduler = Scheduler(
            cache, self.copy_blocks, max_num_seqs, max_num_batched_tokens, prefill_chunk,
            watermark, defer,
        )  # fmt: skip
        self.states: dict[str, RequestState] = {}
        self.results: list[RequestResult] = []
        self.samples: list[StepSample] = []
        self.on_finish: Callable[[RequestResult], None] = lambda _result: None
        # called after every step (runconfig.start_kv_events: the KV-event publisher's poll)
        self.on_step: Callable[[], object] = lambda: None
        # where each step's time went: host seconds per phase, the GPU's time per step
        self.timer = StepTimer(self.device)
        # guard mode: the last step's recorded violations on their way to the host
        self.errors = violations.ErrorCopy(self.device)
        # guard mode: a finished stream's slots swept before its free (slot provenance on)
        self.sweeping = guarded(cache)
        # each step's picked tokens (or logits) on their way to the host
        self.picks = HostCopy(self.device)
        # each step's scored positions (scoring requests) on their way to the host
        self.scores = HostCopy(self.device)
        # serve.py --offload: finished requests' K/V copied to the host under read leases
        self.offloader: Offloader | None = None

    def offload(self, offloader: Offloader) -> None:
        """Copy each finishing request's blocks to host memory on `offloader`'s thread (its
        sweep for leaked leases runs after every step; `run` waits for the copies at its end)."""
        self.offloader = offloader
        self.scheduler.offload = offloader.submit

    def now(self) -> float:
        """Seconds since the run started."""
        return self.clock() - self.start_s

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Perform the pool's copy-on-write copies before anything writes the new blocks, and
        tell the pool (`pool=`: a recording pool's log holds them, docs/REPLAY.md). (Only a
        pool returns copies: the static baseline never does.)"""
        if copies:
            # (on the host: the kernel uploads them, and the pool reads them without a sync)
            pairs = torch.tensor(copies, dtype=torch.int64)
            kernels.copy_blocks(self.cache.kv, pairs[:, 0], pairs[:, 1], pool=self.cache)

    def add(self, request: Request) -> None:
        """Queue a request: its first stream waits for admission."""
        assert request.request_id not in self.states, f"duplicate request {request.request_id}"
        result = RequestResult(request.request_id, request.arrival_s, len(request.prompt))
        result.worker = self.worker
        state = RequestState(request, result)
        self.states[request.request_id] = state
        problem = self._too_large(request)
        if problem:
            self._fail(state, problem)
            return
        stream = self._new_stream(request, 0)
        state.streams.append(stream)
        self.scheduler.add(stream)

    def run(self, requests: list[Request], start_s: float | None = None) -> list[RequestResult]:
        """Serve requests at their arrival times (relative to `start_s`, on the engine's clock)
        until all are done."""
        if start_s is not None:
            self.start_s = start_s
        pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        while pending or self.scheduler.has_work():
            now = self.now()
            while pending and pending[0].arrival_s <= now:
                self.add(pending.popleft())
            if self.scheduler.has_work():
                self.step()
                self.on_step()
                if self.offloader is not None:
                    self.offloader.sweep()
                if isinstance(self.clock, StepClock):
                    self.clock.tick()
            elif pending:
                wait = max(0.0, pending[0].arrival_s - now)
                if isinstance(self.clock, StepClock):
                    self.clock.sleep(wait)
                else:
                    time.sleep(min(0.05, wait))
        self._take_violations()
        if self.offloader is not None:
            self.offloader.close()
        return self.results

    def step(self) -> int:
        """Admit, run one batch through the model, sample and append; returns tokens computed."""
        began = self.now()
        t0 = time.perf_counter()
        admitted = self.scheduler.admit()
        # a deferred stream is counted from the step that deferred it: its wait for the
        # prefix it will hit is part of its time to first token
        for stream in admitted + self.scheduler.deferred:
            result = self.states[stream.request.request_id].result
            if result.admitted_s < 0:
                result.admitted_s = began
        chunks = self.scheduler.plan()
        if not chunks:
            self._stall()
            return 0
        t1 = time.perf_counter()
        batch = Batch(chunks, self.cache, self.device)
        batch.check_writes()
        t2 = time.perf_counter()
        events = self.timer.gpu_began(mixed=batch.num_prefill_tokens > 0)
        hidden = self.graphs.forward(batch) if self.graphs is not None else None
        if hidden is None:
            hidden = self.model(batch.tokens, batch.positions, batch.attend)
        t3 = time.perf_counter()
        if batch.guarded:
            self._take_violations()  # the last step's, when it sampled nothing
            self.errors.start(batch)
        scores = self._score(batch, hidden)
        for chunk in batch.chunks:
            chunk.stream.num_computed += chunk.length
        finished = [
            (c.stream, row)
            for c, row in zip(batch.chunks, batch.last_rows, strict=True)
            if c.stream.num_pending == 0
        ]
        done = [(s, row) for s, row in finished if not s.request.is_scoring]
        scored = [s for s, _ in finished if s.request.is_scoring]
        # the token pick is queued before the publications: what the pool queues on the
        # stream for them (a probed CUDA pool's digests) runs after it, not before the tokens
        picks = self._pick(done, hidden, events)
        self._publish([chunk.stream for chunk in batch.chunks])
        t4 = t5 = time.perf_counter()
        if done or scores is not None:
            chosen = picks()
            if scores is not None:
                scores()
            t5 = time.perf_counter()
            # (the step's tokens or scores were copied behind its error buffer, on the same
            # stream, and waited for: the error buffer is on the host)
            self._take_violations(copied=True)
            for (stream, _), pick in zip(done, chosen, strict=True):
                # a request cancelled earlier in this loop has no state any more
                if stream.request.request_id in self.states:
                    self._complete(stream, pick)
        # what the finished scoring streams held in this step: counted in its cache sample
        held = [(s.request.request_id, list(s.seq.block_table), s.seq.num_tokens) for s in scored]
        # (a last chunk of only the continuation's last token scores nothing: no logits read)
        for stream in scored:
            self._scored(stream)
        t6 = time.perf_counter()
        self._sample_cache(began, batch.num_tokens, held)
        t7 = time.perf_counter()
        self.timer.add((t0, t1, t2, t3, t4, t5, t6, t7))
        return batch.num_tokens

    def _pick(
        self, done: list[tuple[Stream, int]], hidden: Tensor, events: Any
    ) -> Callable[[], list[Any]]:
        """Queue the logits of the rows that finished their pending tokens and their copy to
        the host; what reads them (waiting for the copy): the greedy tokens chosen on the
        device (only ids cross to the host, not [rows, vocab] floats), else each row's logits."""
        if not done:
            self.errors.flush()
            self.timer.gpu_ended(events)
            return list
        logits = self.model.logits(hidden[self.picks.upload([row for _, row in done])])
        greedy = all(stream.request.temperature <= 0 for stream, _ in done)
        if greedy:
            # guard mode, a step the graphs ran: the tokens written into its readback, which
            # brings them back with the error buffer in one copy (violations.ErrorCopy.picks;
            # its wait also covers the upload above, as picks.wait would)
            into = self.errors.picks(len(done))
            if into is not None:
                torch.argmax(logits, -1, out=into)
                self.timer.gpu_ended(events)
                words, count = self.errors.flush(), len(done)

                def read_back() -> list[Any]:
                    self.errors.wait()
                    return words[:count].tolist()

                return read_back
            logits = logits.argmax(-1)
        self.errors.flush()
        self.timer.gpu_ended(events)
        host = self.picks.start(logits)

        def read() -> list[Any]:
            self.picks.wait()
            return host.tolist() if greedy else list(host)

        return read

    def _score(self, batch: Batch, hidden: Tensor) -> Callable[[], None] | None:
        """Queue the log-probabilities of the scoring requests' continuation tokens computed in
        this step (from the logits of the position before each) and their copy to the host;
        what writes them into their streams once copied (None: nothing scored this step)."""
        rows: list[int] = []
        targets: list[int] = []
        # (stream, first continuation index, count) for each chunk that scores something
        spans: list[tuple[Stream, int, int]] = []
        row = 0
        for chunk in batch.chunks:
            request = chunk.stream.request
            if request.is_scoring:
                # position p's logits score token p + 1: positions [P - 1, P + C - 1)
                first_pos = len(request.prompt) - 1
                begin = max(chunk.start, first_pos)
                end = min(chunk.start + chunk.length, request.num_tokens - 1)
                if begin < end:
                    rows.extend(range(row + begin - chunk.start, row + end - chunk.start))
                    targets.extend(request.continuation[begin - first_pos : end - first_pos])
                    spans.append((chunk.stream, begin - first_pos, end - begin))
            row += chunk.length
        if not rows:
            return None
        n = len(rows)
        # (guard mode: the error buffer's copy queued before this step's other copies)
        self.errors.flush()
        index = self.scores.upload(rows + targets)
        logits = self.model.logits(hidden[index[:n]])
        target = index[n:]
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, target[:, None])[:, 0]
        greedy = (logits.argmax(-1) == target).float()
        host = self.scores.start(torch.stack([logprobs, greedy]))

        def read() -> None:
            self.scores.wait()
            values, flags = host.tolist()
            at = 0
            for stream, first, count in spans:
                if not stream.logprobs:
                    size = len(stream.request.continuation)
                    stream.logprobs, stream.greedy = [0.0] * size, [False] * size
                stream.logprobs[first : first + count] = values[at : at + count]
                stream.greedy[first : first + count] = [f > 0.5 for f in flags[at : at + count]]
                at += count

        return read

    def _scored(self, stream: Stream) -> None:
        """A scoring stream computed its last token: its scores are the request's result."""
        state = self.states.get(stream.request.request_id)
        if state is None:
            return
        assert len(stream.logprobs) == len(stream.request.continuation)
        state.result.logprobs = list(stream.logprobs)
        state.result.is_greedy = all(stream.greedy)
        state.result.first_token_s = self.now()
        self._finish(state, stream)

    def _take_violations(self, copied: bool = False) -> None:
        """Report what the kernels of the step whose error buffer is being copied recorded
        (`copied`: a copy queued after it was waited for)."""
        taken = self.errors.take(copied)
        if taken is not None:
            violations.report(self.cache, *taken)

    def _publish(self, streams: list[Stream]) -> None:
        """Tell the pool which full blocks now hold computed K/V, so others can reuse them: the
        step's streams that completed a block, in one call (a probed CUDA pool checks what they
        publish in one launch)."""
        if not self.prefix_cache:
            return
        block_size = self.cache.config.block_size
        ready = [s for s in streams if s.num_computed // block_size > s.num_published // block_size]
        if not ready:
            return
        self.cache.mark_computed_many([s.seq for s in ready], [s.num_computed for s in ready])
        for stream in ready:
            stream.num_published = stream.num_computed

    def _complete(self, stream: Stream, pick: Tensor | int) -> None:
        """A stream computed its last token: sample from its logits (or take the greedy token
        `pick` chosen on the device); a finished prompt with n > 1 forks first."""
        state = self.states[stream.request.request_id]
        emitting = [stream]
        if stream.index == 0 and stream.request.n > 1 and not state.forked:
            state.forked = True
            for index in range(1, stream.request.n):
                child = self._new_stream(stream.request, index)
                state.streams.append(child)
                if stream.running and self.scheduler.fork(stream, child):
                    emitting.append(child)
                else:
                    # no room to fork: the child starts over as a request of its own
                    self.scheduler.add(child)
        for s in emitting:
            if s.request.request_id in self.states:
                if isinstance(pick, int):
                    self._emit(s, pick)
                else:
                    self._emit(s, sample(pick, s.request.temperature, s.generator))

    def _emit(self, stream: Stream, token: int) -> None:
        """Record a sampled token; finish the stream or reserve the token's slot."""
        state = self.states[stream.request.request_id]
        stream.output.append(token)
        if state.result.first_token_s < 0:
            state.result.first_token_s = self.now()
        if len(stream.output) >= stream.request.max_tokens:
            self._finish(state, stream)
        elif len(stream.output) == stream.request.cancel_after:
            self._cancel(state)
        elif stream.running:
            self.scheduler.append(stream, token)
        else:
            stream.pending_token = token

    def _finish(self, state: RequestState, stream: Stream) -> None:
        """Free a finished stream; a request is done when all its streams are."""
        seq = stream.seq
        state.result.reserved_slots += len(seq.block_table) * self.cache.config.block_size
        state.result.stored_tokens += seq.num_tokens if seq.block_table else 0
        if stream.index == 0:
            state.result.num_hit_tokens = max(stream.num_hit_tokens, 0)
        if self.sweeping and seq.block_table and getattr(self.cache, "provenance_sample", 0):
            # slot provenance, guard mode: every slot the stream read swept once more before
            # it is freed (Batch.check_writes sweeps a decoding sequence at a few blocks only)
            self.cache.check_provenance([seq])
        self.scheduler.finish(stream)
        state.num_finished += 1
        if state.num_finished == stream.request.n:
            state.result.finish_s = self.now()
            state.result.outputs = [s.output for s in sorted(state.streams, key=lambda s: s.index)]
            self._done(state)

    def _cancel(self, state: RequestState) -> None:
        """The client gave up on the request: abort all its streams in the pool."""
        for stream in state.streams:
            self.scheduler.abort(stream)
        result = state.result
        result.cancelled = True
        result.num_hit_tokens = max(state.streams[0].num_hit_tokens, 0)
        result.finish_s = self.now()
        result.outputs = [s.output for s in sorted(state.streams, key=lambda s: s.index)]
        self._done(state)

    def _fail(self, state: RequestState, error: str) -> None:
        """Give up on a request that cannot be served, returning whatever it holds."""
        for stream in state.streams:
            self.scheduler.abort(stream)
        state.result.error = error
        state.result.finish_s = self.now()
        self._done(state)

    def _done(self, state: RequestState) -> None:
        """Hand a request's result out."""
        del self.states[state.request.request_id]
        self.results.append(state.result)
        self.on_finish(state.result)

    def _stall(self) -> None:
        """Nothing could run: the oldest waiting stream does not fit."""
        head = self.scheduler.waiting[0]
        if self.exclusive and not self.scheduler.running:
            free = self.cache.stats().get("num_free", -1)
            error = f"does not fit: the pool has {free} free blocks and nothing else runs"
            self._fail(self.states[head.request.request_id], error)
        else:
            # other processes hold the blocks; they will give some back
            time.sleep(0.002)

    def _too_large(self, request: Request) -> str:
        """Why a request can never be served by this cache ('' when it can)."""
        config = self.cache.config
        length = request.num_tokens + request.max_tokens
        if isinstance(self.cache, StaticCache):
            if length > self.cache.max_len:
                return f"prompt + max_tokens = {length} exceeds the static max_len {self.cache.max_len}"
            blocks = self.cache.blocks_per_seq * request.n
        else:
            blocks = -(-request.num_tokens // config.block_size)
            blocks += request.n * -(-request.max_tokens // config.block_size) + request.n
        if blocks > config.num_blocks:
            return f"needs up to {blocks} blocks, the pool has {config.num_blocks}"
        return ""

    def _new_stream(self, request: Request, index: int) -> Stream:
        """A stream with its own seeded generator when sampling with a temperature."""
        generator = None
        if request.temperature > 0:
            key = f"{self.seed}:{request.request_id}:{index}".encode()
            generator = torch.Generator().manual_seed(zlib.crc32(key))
        return Stream(request, index, generator)

    def _sample_cache(
        self, began: float, num_tokens: int, finished: list[tuple[str, list[int], int]]
    ) -> None:
        """Record how many tokens the cache stores in how many reserved slots.

        A block shared by several sequences counts once, as full as its fullest user: only a
        sequence's last blocks are partly filled, so the full ones are gathered a slice at a time.
        `finished`: (request id, block table, tokens) of the scoring requests this step finished,
        counted as held and running in it (a scoring request lives one step or a few).
        """
        block_size = self.cache.config.block_size
        full: set[int] = set()
        tails: dict[int, int] = {}
        tables = [
            (stream.seq.block_table, stream.seq.num_tokens)
            for stream in list(self.scheduler.running) + list(self.scheduler.waiting)
            if stream.seq is not None
        ]
        for table, num_tokens_seq in tables + [(table, n) for _, table, n in finished]:
            if not table:
                continue
            num_full = min(num_tokens_seq // block_size, len(table))
            full.update(table[:num_full])
            for i in range(num_full, len(table)):
                used = max(0, num_tokens_seq - i * block_size)
                tails[table[i]] = max(tails.get(table[i], 0), used)
        partial = {b: used for b, used in tails.items() if b not in full}
        end = self.now()
        num_blocks = len(full) + len(partial)
        stored, reserved = len(full) * block_size + sum(partial.values()), num_blocks * block_size
        running = len(
            {s.request.request_id for s in self.scheduler.running} | {f[0] for f in finished}
        )
        mapped = sum(len(table) for table, _ in tables) + sum(len(t) for _, t, _ in finished)
        sample = StepSample(
            end, end - began, stored, reserved, num_tokens, running, self.worker, num_blocks, mapped
        )
        self.samples.append(sample)
