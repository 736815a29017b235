"""Engine steps replayed as CUDA graphs: decode steps per batch size, mixed steps per token count.

A step of a large model launches about 30 kernels per layer from Python; at a batch of a dozen
sequences the GPU finishes each one faster than Python issues the next, so the step is as long
as its launches. A CUDA graph replays all of them from one call.

    graphs = StepGraphs(model, cache, max_seqs=12, max_len=1152, max_tokens=4096, max_chunk=2048)
    hidden = graphs.forward(batch)   # None: a step that fits no graph: eager

Two families of graphs over the same static input buffers:
- decode steps (every chunk one token): one graph per batch size 1..max_seqs, attention
  through `paged_decode` (split over the sequence: the fast path for long contexts);
- steps holding a prompt chunk: one graph per token-count bucket (16, 32, ... max_tokens; a
  step runs in the smallest bucket that holds it, the padding rows store nothing), every chunk,
  decodes included, attended by `paged_prefill` over `max_seqs` sequence rows (the unused rows
  have no new tokens: their programs return at once).

A step's inputs (tokens, positions, slots, block tables, lengths, chunk starts) are written on
the host into one page-locked buffer per dtype and copied to the static buffers in one transfer
each. Block tables are padded with -1 to `max_len`'s width (no kernel reads an entry past a
sequence's length). On the CPU nothing is captured: the same static-buffer forwards run
eagerly, so the tests check the buffers' bookkeeping against the ordinary path.

Guard mode (batch.guarded) is captured too: every graph checks against one static block-state
buffer and records into one static error buffer, and begins with the block-table audit of the
whole static table (KVPool.table_audit: the comparison with the expected table the pool writes
each step). A step's expected table (on CUDA) and pool block states travel in its int32
transfer (after the tables, lengths and starts); each forward zeroes the error count first (in
the graph: no launch of its own); the engine copies the error buffer back behind the step (a
host read right after the launch would wait for the whole forward), and with it (on CUDA) the
audit's answer and a greedy step's sampled tokens, one buffer holding them all (`Readback`),
the answer handed to the audit once on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvscope import kernels
from kvscope.allocator import faults

from .batch import Batch, guarded
from .model import LlamaModel


def token_buckets(max_tokens: int) -> list[int]:
    """Padded token counts of the mixed-step graphs: steps of 16 to 128, then about 1.25x."""
    buckets, b = [], 16
    while b < max_tokens:
        buckets.append(b)
        b = b + 16 if b < 128 else -(-int(b * 1.25) // 64) * 64
    return buckets + [max_tokens]


class Readback:
    """Guard mode: what the host reads back of a step the graphs ran, in one copy
    (violations.ErrorCopy): `buffer`, int32, holds the error buffer (its first `errors` words)
    and, from word `answer_at` (-1: none), the block-table audit's answer (4 int64, which
    `audit` takes with `TableAudit.answered`), and from word `picks_at` (-1: none) room for
    `max_picks` int64: a greedy step's sampled tokens, written there by the engine after the
    replay so that they come back in the same copy (ErrorCopy.picks)."""

    def __init__(
        self, buffer: Tensor, errors: int, answer_at: int, picks_at: int = -1, max_picks: int = 0
    ) -> None:
        self.buffer = buffer
        self.errors = errors
        self.answer_at = answer_at
        self.picks_at = picks_at
        self.max_picks = max_picks if picks_at >= 0 else 0
        # the picks' int64 words on the device, viewed once
        self.picks = buffer[picks_at:].view(torch.int64) if picks_at >= 0 else None
        self.audit: Any = None

    @classmethod
    def make(cls, device: torch.device, audited: bool, max_picks: int) -> Readback:
        """A new readback on `device`: a new error buffer, then (`audited`) the audit's answer,
        int64 [4] from an int64 boundary, then room for `max_picks` picks (int64)."""
        errors = kernels.new_error_buffer(device=device)
        n = errors.numel()
        at = n + (n & 1)
        picks_at = at + 8 if audited else at
        buffer = torch.zeros(picks_at + 2 * max_picks, dtype=torch.int32, device=device)
        buffer[:n].copy_(errors)
        return cls(buffer, n, at if audited else -1, picks_at, max_picks)

    def answer(self) -> Tensor | None:
        """The audit's answer words on the device (int64 [4]; None: none)."""
        at = self.answer_at
        return self.buffer[at : at + 8].view(torch.int64) if at >= 0 else None

    def step(self) -> tuple[Readback, int]:
        """This step's: the readback and the token of its replay's audit answer (0: none)."""
        return self, self.audit.replayed() if self.audit is not None else 0


class StepGraphs:
    """Static step inputs and, on CUDA, one captured model forward per step shape."""

    def __init__(
        self,
        model: LlamaModel,
        cache: Any,
        max_seqs: int,
        max_len: int,
        max_tokens: int = 0,
        max_chunk: int = 0,
        audit: bool | None = None,
    ) -> None:
        assert max_seqs >= 1 and max_len >= 1
        self.model = model
        self.kv = cache.kv
        self.block_size = cache.config.block_size
        self.max_seqs = max_seqs
        self.width = -(-max_len // self.block_size)
        # max_tokens 0: decode graphs only
        self.buckets = token_buckets(max_tokens) if max_tokens > 0 else []
        self.max_chunk = max_chunk or max_tokens
        self.device = model.lm_head.weight.device
        rows = max([max_seqs, *self.buckets])
        # guard mode: the block states (1: ALLOCATED), one byte each, after the int32 inputs
        num_states = cache.config.num_blocks if guarded(cache) else 0
        # the block-table audit of the whole static table, padding rows included (guard mode's,
        # or as `audit` says): its comparison captured in every graph, before any kernel reads
        # the table; each step writes the expected table (KVPool.table_audit)
        if audit is None:
            audit = bool(num_states)
        make = getattr(cache, "table_audit", None) if audit else None
        pin = self.device.type == "cuda"
        # On CUDA the audit's expected table travels in the int32 transfer (after the chunk
        # starts) and its answer comes back with the error buffer: a copy and an event fewer
        # a step each (KVPool.table_audit's `expected` and `answer`)
        num_expected = max_seqs * self.width if make is not None and pin else 0
        # int64: tokens, positions, slots; int32: tables, lens, chunk starts (then the expected
        # table, and block states)
        self.n32 = max_seqs * self.width + max_seqs + max_seqs + 1
        self.states_at = self.n32 + num_expected
        size32 = self.states_at + -(-num_states // 4)
        self.host64 = torch.zeros(3, rows, dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.zeros(size32, dtype=torch.int32, pin_memory=pin)
        self.dev64 = torch.zeros(3, rows, dtype=torch.int64, device=self.device)
        self.dev32 = torch.zeros(size32, dtype=torch.int32, device=self.device)
        self.np64, self.np32 = self.host64.numpy(), self.host32.numpy()
        # guard mode: the block states and the error buffer every graph reads
        self.cache = cache
        self.guard: dict[str, Tensor] = {}
        self.host8 = self.host32[self.states_at :].view(torch.uint8)[:num_states]
        self.np8 = self.host8.numpy()
        # guard mode: what a step brings back to the host (violations.ErrorCopy)
        self.readback: Readback | None = None
        answer = None
        if num_states:
            # the error buffer, then (on CUDA, auditing) the audit's answer, then room for a
            # greedy step's picks (a row each), in one buffer copied back in one
            self.readback = Readback.make(self.device, bool(num_expected), max_seqs)
            self.guard = {
                "block_state": self.dev32[self.states_at :].view(torch.uint8)[:num_states],
                "errors": self.readback.buffer[: self.readback.errors],
            }
            answer = self.readback.answer()
        expected = None
        if num_expected:
            shape = (max_seqs, self.width)
            end = self.states_at
            expected = (
                self.host32[self.n32 : end].view(shape),
                self.dev32[self.n32 : end].view(shape),
            )
        self.audit = make(self._tables(), expected=expected, answer=answer) if make else None
        if self.readback is not None and answer is not None:
            self.readback.audit = self.audit
        self.np64[2] = -1  # slot -1: store nothing (the captures' own forwards write no block)
        self.np32[self.max_seqs * self.width :] = 0
        self.np32[self.n32 : self.states_at] = -1  # (the expected table: all padding)
        # the last transfer from the page-locked buffers: wait for it before writing them again
        self.copied = torch.cuda.Event() if pin else None
        self._load()
        # key -> (graph, its output hidden states); key: ("decode", n) or ("mixed", tokens)
        self.graphs: dict[tuple[str, int], tuple[Any, Tensor]] = {}
        # steps served from the static buffers, and how many of them were graph replays
        self.num_forwards = 0
        self.num_replays = 0
        self.num_mixed = 0
        # rows the last step's tables filled (stale-padding-row: what a shorter step leaves)
        self.rows_written = 0
        if self.device.type == "cuda":
            self._capture_all()

    # views of the device buffers the captured kernels read
    def _tables(self) -> Tensor:
        return self.dev32[: self.max_seqs * self.width].view(self.max_seqs, self.width)

    def _lens(self) -> Tensor:
        first = self.max_seqs * self.width
        return self.dev32[first : first + self.max_seqs]

    def _starts(self) -> Tensor:
        return self.dev32[self.max_seqs * self.width + self.max_seqs : self.n32]

    def forward(self, batch: Batch) -> Tensor | None:
        """Hidden states [tokens, hidden] of `batch`, or None when no graph fits it."""
        n = len(batch.chunks)
        if n > self.max_seqs or max(batch.seq_lens) > self.width * self.block_size:
            return None
        if batch.num_prefill_tokens == 0:
            key = ("decode", n)
        else:
            bucket = next((b for b in self.buckets if b >= batch.num_tokens), 0)
            if not bucket or batch.max_query_len > self.max_chunk:
                return None
            key = ("mixed", bucket)
            self.num_mixed += 1
        self._write(batch)
        # the audit's expected table: on CUDA into the int32 transfer (before it); a host
        # table is audited once the step's tables are in it (after)
        staged = self.audit is not None and self.states_at > self.n32
        # (the rows are every chunk's: Batch.audit_rows(batch.chunks), made once per batch)
        if staged:
            self.audit.expect(batch.seqs, batch.seq_lens)
        self._load()
        if self.audit is not None and not staged:
            self.audit.expect(batch.seqs, batch.seq_lens)
        if self.guard:
            batch.guard = self.guard
            if self.readback is not None:
                batch.readback = self.readback.step()
        self.num_forwards += 1
        if key in self.graphs:
            graph, out = self.graphs[key]
            graph.replay()
            self.num_replays += 1
            return out[: batch.num_tokens]
        return self._forward(*key)[: batch.num_tokens]

    def _write(self, batch: Batch) -> None:
        """The step's inputs into the page-locked buffers (rows past the step: store nothing)."""
        if self.copied is not None:
            self.copied.synchronize()
        t, n = batch.num_tokens, len(batch.chunks)
        self.np64[0, :t] = batch.host_tokens
        self.np64[1, :t] = batch.host_positions
        self.np64[2, :t] = batch.host_slots
        self.np64[2, t:] = -1
        first = self.max_seqs * self.width
        tables = self.np32[:first].reshape(self.max_seqs, self.width)
        if n < self.rows_written and faults.opportunity("stale-padding-row"):
            # the fault: the padding rows keep the earlier, larger step's block ids
            tables[:n] = -1
            faults.fired("stale-padding-row")
        else:
            tables[:] = -1
            self.rows_written = n
        tables[:n] = batch.host_tables(batch.chunks, self.width)
        lens = self.np32[first : first + self.max_seqs]
        lens[:] = 0
        lens[:n] = batch.seq_lens
        starts = self.np32[first + self.max_seqs : self.n32]
        starts[0] = 0
        starts[1 : n + 1] = np.cumsum([c.length for c in batch.chunks])
        starts[n + 1 :] = t
        if self.guard:
            self.cache.block_state(out=self.np8)

    def _load(self) -> None:
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)  # (and guard mode's block states)
        if self.copied is not None:
            self.copied.record()

    def _forward(self, kind: str, size: int) -> Tensor:
        """The model over the first `size` rows of the static buffers."""
        tokens, positions = self.dev64[0, :size], self.dev64[1, :size]
        if self.audit is not None:
            self.audit.launch()
        if self.guard:
            # the error count zeroed in the forward (captured with it: no launch of its own),
            # after the last step's copy of the buffer to the host
            self.guard["errors"][:1].zero_()
        return self.model(tokens, positions, self._attend(kind, size))

    def _attend(self, kind: str, size: int) -> Callable[[int, Tensor, Tensor, Tensor], Tensor]:
        """Store K/V into the pool, then paged attention over the static buffers."""
        slots, bs = self.dev64[2, :size], self.block_size
        tables, lens, starts = self._tables(), self._lens(), self._starts()
        max_seq_len = self.width * bs
        max_query_len = min(size, self.max_chunk)
        guard = self.guard  # {} when off

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            k_cache, v_cache = self.kv[layer, 0], self.kv[layer, 1]
            kernels.store_kv(k, v, k_cache, v_cache, slots, block_size=bs, **guard)
            if kind == "decode":
                return kernels.paged_decode(
                    q, k_cache, v_cache, tables[:size], lens[:size],
                    block_size=bs, max_seq_len=max_seq_len, **guard,
                )  # fmt: skip
            return kernels.paged_prefill(
                q, k_cache, v_cache, tables, lens, starts,
                block_size=bs, max_query_len=max_query_len, **guard,
            )  # fmt: skip

        return attend

    def _capture_all(self) -> None:
        """Capture every shape, largest first so the smaller ones reuse its memory."""
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        keys = [("mixed", b) for b in reversed(self.buckets)]
        keys += [("decode", n) for n in range(self.max_seqs, 0, -1)]
        for key in keys:
            # Warm up off the capture (Triton compiles, cuBLAS picks its kernels), on a side
            # stream as torch's graph docs ask.
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward(*key)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(*key)
            self.graphs[key] = (graph, out)
        torch.cuda.synchronize(self.device)
