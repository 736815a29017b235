"""First-come-first-served continuous batching over the pool: admit, plan a step, preempt.

A stream is one sampled output of a request (a request with `n > 1` has n streams, forked
from the first when its prompt is done). A running stream always has at least one token whose
K/V is not computed yet: the prompt's remainder, or the token sampled last step.

A new stream whose prompt begins with blocks a running stream computes in the coming step (the
same chain of block-sized token prefixes) is deferred: the pool publishes a block at
`mark_computed`, once its K/V is written (at the end of the step that computes it), so a stream
allocated in that step would compute a copy of its own. The deferred stream keeps its place at
the head of the queue and its seat in the batch (later streams are admitted into the seats
left), and is admitted in the next step, hitting the blocks. Requests that arrive together on
one new context (the choices of a multiple-choice question, the first requests behind a new
system prompt) compute it once; each one deferred starts a step later (another step for each
further chunk of a context longer than a step computes). A stream whose shared blocks are not
computed in the coming step (the stream computing them waits for room in the step's token
budget) is not deferred: it would wait more than a step. Admission also counts, before
allocating, a new stream's hits on blocks running streams hold published: they take nothing
from the pool. Deferral is on where the engine publishes blocks (`defer`: prefix sharing on).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvscope.allocator import PoolExhausted

from .workload import Request

CopyFn = Callable[[list[tuple[int, int]]], None]


def block_keys(tokens: list[int], block_size: int) -> list[int]:
    """One key per full block of `tokens`, each chained on the one before it: two keys are
    equal when the tokens from position 0 to the block's end are (as the pool's prefix index
    matches blocks; a hash collision would only defer a stream needlessly or misjudge room)."""
    keys: list[int] = []
    key = 0
    for end in range(block_size, len(tokens) + 1, block_size):
        key = hash((key, *tokens[end - block_size : end]))
        keys.append(key)
    return keys


# eq=False: a stream is itself, not its fields (a field-by-field __eq__ made each `in` over the
# running list compare requests and outputs: a third of the example server's host time).
@dataclass(eq=False)
class Stream:
    """One output stream: its pool sequence, how much of it has K/V, what it generated."""

    request: Request
    index: int
    generator: torch.Generator | None = None
    seq: Any = None
    num_computed: int = 0
    num_published: int = 0
    # sampled while the stream was set aside, not yet appended to the pool (-1: none)
    pending_token: int = -1
    # prompt tokens found in the pool's prefix index at the first admission (-1: not admitted)
    num_hit_tokens: int = -1
    output: list[int] = field(default_factory=list)
    # in the scheduler's running list (kept by the scheduler: a list search per step was O(n^2))
    running: bool = False
    # a scoring request: each continuation token's log-probability and whether it was the
    # argmax, filled in as the steps compute the positions before them
    logprobs: list[float] = field(default_factory=list)
    greedy: list[bool] = field(default_factory=list)
    # the request's full blocks (prompt, then continuation) as chained keys, one a block:
    # the same key, the same tokens from position 0 to the block's end (block_keys)
    keys: list[int] | None = None
    # deferred at least once, waiting for a running stream to publish its prefix
    deferred: bool = False

    @property
    def name(self) -> str:
        """The pool's request id of this stream: `r7`, then `r7#1`, `r7#2` for forks."""
        rid = self.request.request_id
        return rid if self.index == 0 else f"{rid}#{self.index}"

    @property
    def num_pending(self) -> int:
        """Tokens reserved in the pool whose K/V is still to be computed."""
        return self.seq.num_tokens - self.num_computed


# What a running stream's full block is to a new stream whose prompt has the same prefix
HELD = 0  # published, in a running stream's table: a hit on it takes nothing from the pool
NEXT = 1  # computed in the coming step, published at its end
LATER = 2  # computed in a step after that


class RunningPrefixes:
    """The running streams' full blocks as a new stream finds them (HELD, NEXT, LATER), for
    admission, and the prompt tokens left in the coming step's budget: which blocks the step
    computes is planned as `Scheduler.plan` does (decodes, then prompt chunks in running
    order). Streams are grouped by their first block's key, so a new stream is compared only
    with those that share its first block."""

    def __init__(self, block_size: int, budget: int, prefill_chunk: int) -> None:
        self.block_size = block_size
        self.budget = budget
        self.prefill_chunk = prefill_chunk
        # first block's key -> (keys, blocks published, blocks published after the coming step)
        self.by_first: dict[int, list[tuple[list[int], int, int]]] = {}

    def keys(self, stream: Stream) -> list[int]:
        """The stream's request's full blocks as chained keys (computed once)."""
        if stream.keys is None:
            request = stream.request
            stream.keys = block_keys(request.prompt + request.continuation, self.block_size)
        return stream.keys

    def add(self, stream: Stream) -> None:
        """A running stream, its prompt chunk taken from the budget (decodes are counted
        before any stream is added)."""
        pending = stream.seq.num_tokens - stream.num_computed
        length = max(min(pending, self.prefill_chunk, self.budget), 0) if pending > 1 else 0
        self.budget -= length
        keys = self.keys(stream)
        if keys:
            num_published = stream.num_published // self.block_size
            num_next = (stream.num_computed + length) // self.block_size
            self.by_first.setdefault(keys[0], []).append((keys, num_published, num_next))

    def match(self, stream: Stream) -> tuple[bool, int]:
        """Whether to defer a new stream (the first of its prompt's blocks a running stream
        is computing is computed in the coming step: one step's wait makes it a hit), and how
        many of its leading blocks running streams hold published."""
        # a prefix hit stops before the prompt's last token (pool.allocate)
        num_hittable = (len(stream.request.prompt) - 1) // self.block_size
        keys = self.keys(stream)[:num_hittable]
        group = self.by_first.get(keys[0], []) if keys else []
        num_held = 0
        for k, key in enumerate(keys):
            # the best any running stream with this block offers (chained keys: the same
            # block's key, the same prefix)
            state = -1
            for theirs, num_published, num_next in group:
                if k < len(theirs) and theirs[k] == key:
                    mine = HELD if k < num_published else NEXT if k < num_next else LATER
                    state = mine if state < 0 else min(state, mine)
            if state < 0:
                break
            if state != HELD:
                return state == NEXT, num_held
            num_held += 1
        return False, num_held


@dataclass
class Chunk:
    """Part of a step: compute K/V of `stream` positions [start, start + length)."""

    stream: Stream
    start: int
    length: int


class Scheduler:
    """Holds waiting and running streams; decides who runs each step and who is set aside."""

    def __init__(
        self,
        cache: Any,
        copy_blocks: CopyFn,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 256,
        prefill_chunk: int = 64,
        watermark: float = 1.0,
        defer: bool = False,
    ) -> None:
        assert max_num_seqs >= 1 and prefill_chunk >= 1
        self.cache = cache
        self.copy_blocks = copy_blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk = prefill_chunk
        # free blocks to keep per running stream when admitting, so they can grow (0: static)
        self.watermark = watermark
        self.waiting: deque[Stream] = deque()
        self.running: list[Stream] = []
        self.num_preemptions = 0
        self.num_set_aside = 0
        # defer a new stream whose prefix a running stream is computing (module docstring)
        self.defer = defer
        # streams deferred at least once; those the last admit() deferred
        self.num_deferred = 0
        self.deferred: list[Stream] = []
        # called with a finishing stream's sequence before its free (serve.py --offload)
        self.offload: Callable[[Any], None] | None = None

    def add(self, stream: Stream) -> None:
        """Queue a new stream behind those already waiting."""
        assert stream.seq is None
        self.waiting.append(stream)

    def _run(self, stream: Stream, at: int | None = None) -> None:
        """Put `stream` in the running list (at the end, or at index `at`)."""
        if at is None:
            self.running.append(stream)
        else:
            self.running.insert(at, stream)
        stream.running = True

    def _stop(self, stream: Stream) -> None:
        """Take `stream` out of the running list."""
        self.running.remove(stream)
        stream.running = False

    def has_work(self) -> bool:
        """Whether any stream waits or runs."""
        return bool(self.waiting or self.running)

    def admit(self) -> list[Stream]:
        """Move waiting streams into the pool, oldest first, until the pool or the batch is
        full; a new stream whose prefix a running stream is computing is deferred (it stays
        waiting, keeping its seat: `deferred`) and the streams behind it are considered."""
        admitted: list[Stream] = []
        self.deferred = []
        available = self._available() if self.watermark > 0 and self.waiting else 0
        # blocks the running streams' tables hold (built at the first prefix hit)
        held: set[int] | None = None
        # the running streams' blocks (published, or computed in this step or later)
        prefixes = self._running_prefixes() if self.defer and self.waiting else None
        # the queue position looked at, and the seats the streams deferred so far keep
        i = 0
        reserved = 0
        while i < len(self.waiting):
            stream = self.waiting[i]
            # a new request will fork into n streams once its prompt is done: count them now
            width = stream.request.n if stream.seq is None and stream.index == 0 else 1
            if self.running and len(self.running) + reserved + width > self.max_num_seqs:
                break
            need = self._blocks_needed(stream)
            num_held = 0
            if prefixes is not None and stream.seq is None:
                defer, num_held = prefixes.match(stream)
                if defer:
                    if not stream.deferred:
                        stream.deferred = True
                        self.num_deferred += 1
                    self.deferred.append(stream)
                    reserved += width
                    i += 1
                    continue
            # (its hits on blocks running streams hold published take nothing from the pool)
            if self.running and not self._has_room(width + reserved, need - num_held, available):
                break
            fresh = stream.seq is None or stream.seq.state == "preempted"
            try:
                self._reserve(stream)
            except PoolExhausted:
                break
            # A prefix hit on a block a running stream holds takes nothing from the pool (one
            # on a cached block takes it, as a new block would): what sharing saves is left
            # for the next admission. The room check above counted the hits on the blocks
            # running streams publish (known from their keys); the exact count is known only
            # once the prompt is allocated.
            num_hits = stream.num_computed // self.cache.config.block_size if fresh else 0
            if num_hits and self.watermark > 0:
                if held is None:
                    held = {b for s in self.running for b in s.seq.block_table}
                need -= sum(b in held for b in stream.seq.block_table[:num_hits])
            if held is not None:
                held.update(stream.seq.block_table)
            available -= need
            del self.waiting[i]
            self._run(stream)
            admitted.append(stream)
            if prefixes is not None:
                prefixes.add(stream)
        return admitted

    def _running_prefixes(self) -> RunningPrefixes:
        """The running streams' blocks as a new stream finds them (RunningPrefixes)."""
        num_decodes = sum(s.num_pending == 1 for s in self.running)
        prefixes = RunningPrefixes(
            self.cache.config.block_size,
            self.max_num_batched_tokens - num_decodes,
            self.prefill_chunk,
        )
        for stream in self.running:
            prefixes.add(stream)
        return prefixes

    def plan(self) -> list[Chunk]:
        """This step's work: every decode, then prompt chunks within the token budget."""
        chunks = [Chunk(s, s.num_computed, 1) for s in self.running if s.num_pending == 1]
        budget = self.max_num_batched_tokens - len(chunks)
        for stream in self.running:
            if stream.num_pending <= 1:
                continue
            length = min(stream.num_pending, self.prefill_chunk, budget)
            if length <= 0:
                break
            chunks.append(Chunk(stream, stream.num_computed, length))
            budget -= length
        return chunks

    def set_aside(self, stream: Stream) -> None:
        """Stop running `stream`: the pool may now take its blocks (it preempts waiting ones)."""
        self._stop(stream)
        self.cache.set_state(stream.seq, "waiting")
        self.waiting.appendleft(stream)
        self.num_set_aside += 1

    def pick_victim(self, exclude: Stream) -> Stream | None:
        """The most recently admitted running stream other than `exclude`."""
        for stream in reversed(self.running):
            if stream is not exclude:
                return stream
        return None

    def append(self, stream: Stream, token: int) -> bool:
        """Append a sampled token, setting others aside while the pool is full.

        Returns False when even that was not enough: `stream` itself is then set aside with
        the token pending, to be appended when it is admitted again.
        """
        while True:
            try:
                self.copy_blocks(self.cache.append(stream.seq, [token]))
                return True
            except PoolExhausted:
                victim = self.pick_victim(exclude=stream)
                if victim is None:
                    stream.pending_token = token
                    self.set_aside(stream)
                    return False
                self.set_aside(victim)

    def fork(self, parent: Stream, child: Stream) -> bool:
        """Fork `parent`'s sequence for `child`, setting others aside while the pool is full."""
        while True:
            try:
                child.seq = self.cache.fork(parent.seq, child.name)
            except PoolExhausted:
                victim = self.pick_victim(exclude=parent)
                if victim is None:
                    return False
                self.set_aside(victim)
                continue
            child.num_computed = child.num_published = parent.num_computed
            self._run(child, at=self.running.index(parent) + 1)
            return True

    def finish(self, stream: Stream) -> None:
        """Free a stream that generated all its tokens (running, or set aside this step)."""
        if stream.running:
            self._stop(stream)
        else:
            self.waiting.remove(stream)
        if stream.seq.state == "preempted":
            # its blocks were taken while it was set aside; it finished without needing them
            self.num_preemptions += 1
        if self.offload is not None:
            self.offload(stream.seq)
        self.cache.free(stream.seq)

    def abort(self, stream: Stream) -> None:
        """Drop a stream that will not finish (cancelled, or cannot be served), returning its
        blocks and its sequence slot; a stream already finished is left alone."""
        if stream.running:
            self._stop(stream)
        elif stream in self.waiting:
            self.waiting.remove(stream)
        if stream.seq is not None and stream.seq.state not in ("finished", "aborted"):
            self.cache.abort(stream.seq)

    def _has_room(self, width: int, need: int, available: int) -> bool:
        """Whether `width` more streams fit the batch and leave `watermark` blocks per stream."""
        num_streams = len(self.running) + width
        if num_streams > self.max_num_seqs:
            return False
        return self.watermark <= 0 or available - need >= self.watermark * num_streams

    def _available(self) -> int:
        """Blocks this process could take now: free, parked locally, or cached (evictable)."""
        stats = self.cache.stats()
        return stats["num_free"] + stats.get("num_local", 0) + stats.get("num_cached", 0)

    def _blocks_needed(self, stream: Stream) -> int:
        """Blocks admitting `stream` takes at most (ignoring prefix hits: admit counts those
        on blocks running streams hold once the stream is allocated)."""
        block_size = self.cache.config.block_size
        if stream.seq is None or stream.request.is_scoring and stream.seq.state == "preempted":
            return -(-stream.request.num_tokens // block_size)
        if stream.seq.state == "preempted":
            return -(-(stream.seq.num_tokens + 1) // block_size)
        return 1 if stream.pending_token != -1 else 0

    def _reserve(self, stream: Stream) -> None:
        """Get blocks for a stream: a new sequence, a resumed one, or one set aside intact."""
        cache = self.cache
        if stream.seq is not None and stream.request.is_scoring and stream.seq.state == "preempted":
            # A scoring stream starts over: resuming matches its whole sequence in the prefix
            # index, and a hit past its prompt would skip positions whose logits it scores.
            cache.abort(stream.seq)
            stream.seq = None
            self.num_preemptions += 1
        if stream.seq is None:
            seq = cache.allocate(stream.name, stream.request.prompt)
            # prefix hits stop before the prompt's last token: every scored position is computed
            if stream.request.continuation:
                try:
                    self.copy_blocks(cache.append(seq, stream.request.continuation))
                except PoolExhausted:
                    cache.abort(seq)
                    raise
            stream.seq = seq
            stream.num_computed = stream.num_published = seq.num_cached_tokens
            if stream.num_hit_tokens < 0:
                stream.num_hit_tokens = seq.num_cached_tokens
        elif stream.seq.state == "preempted":
            stream.num_computed = stream.num_published = cache.resume(stream.seq)
            self.num_preemptions += 1
        else:
            cache.set_state(stream.seq, "running")
        if stream.pending_token != -1:
            try:
                self.copy_blocks(cache.append(stream.seq, [stream.pending_token]))
            except PoolExhausted:
                cache.set_state(stream.seq, "waiting")
                raise
            stream.pending_token = -1
        assert 0 <= stream.num_computed < stream.seq.num_tokens, "nothing left to compute"
