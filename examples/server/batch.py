"""One engine step packed for the model, and its attention through the kvscope kernels.

Prompt chunks come first, then decodes; every new token's K/V is stored into its pool slot
with `store_kv`, then `paged_prefill` attends the chunks over their cached prefix and
`paged_decode` the single tokens over their whole sequence, all on the pool's KV tensor.

The step's inputs are built on the host as numpy arrays (`host_*`, `host_tables`). The eager
forward copies them to the device when it first reads them; the CUDA graphs of a step
(graphs.StepGraphs) copy them into their static buffers instead, in one transfer.

Guard mode (a pool with `config.guard`): the kernels check every block-table entry and slot
against the pool's block states and record violations in an error buffer instead of reading or
writing out of bounds. A step the graphs run uses their static buffers; an eager step makes its
own on first use; violations.ErrorCopy brings a step's error buffer to the host behind the step.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvscope import kernels
from kvscope.probes.stores import Writers

from .scheduler import Chunk


def guarded(cache: Any) -> bool:
    """Whether the kernels run in guard mode on `cache` (a guard-mode pool)."""
    return bool(getattr(cache.config, "guard", False)) and hasattr(cache, "block_state")


def sweeps(position: int, block_size: int) -> bool:
    """Whether a decode at `position` is swept (Batch.check_writes): it starts a block whose
    number is a power of two (or block 0)."""
    block, offset = divmod(position, block_size)
    return offset == 0 and block & (block - 1) == 0


class Batch:
    """Token ids, positions, slots and block tables of one step (host arrays, device tensors)."""

    def __init__(self, chunks: list[Chunk], cache: Any, device: torch.device | str) -> None:
        assert chunks
        self.cache = cache
        self.kv = cache.kv
        self.device = torch.device(device)
        self.block_size = cache.config.block_size
        self.guarded = guarded(cache)
        # guard mode, a step the graphs run: what its error copy brings back, and the token of
        # its block-table audit's answer (graphs.Readback.step; None: the error buffer alone)
        self.readback: tuple[Any, int] | None = None
        prefills = [c for c in chunks if c.length > 1]
        decodes = [c for c in chunks if c.length == 1]
        self.chunks = prefills + decodes
        self.num_prefills = len(prefills)
        self.num_prefill_tokens = sum(c.length for c in prefills)
        lengths = np.array([c.length for c in self.chunks], dtype=np.int64)
        self.num_tokens = int(lengths.sum())
        # index of each chunk's last token in the packed batch: where its logits come from
        self.last_rows = (np.cumsum(lengths) - 1).tolist()
        # total tokens of each chunk's sequence once this step has run
        self.seq_lens = [c.start + c.length for c in self.chunks]
        self.max_query_len = int(lengths.max())
        self.host_tokens = np.empty(self.num_tokens, dtype=np.int64)
        self.host_positions = np.empty(self.num_tokens, dtype=np.int64)
        self.host_slots = np.empty(self.num_tokens, dtype=np.int64)
        slots_per_block = cache.slots_per_block
        # each chunk's block table as this step read it (a finding names the request that
        # maps the block, also once the request has finished and dropped its table)
        self.tables: list[np.ndarray] = []
        row = 0
        for chunk in self.chunks:
            seq = chunk.stream.seq
            end = row + chunk.length
            pos = np.arange(chunk.start, chunk.start + chunk.length, dtype=np.int64)
            table = np.asarray(seq.block_table, dtype=np.int64)
            self.tables.append(table)
            self.host_tokens[row:end] = seq.tokens[chunk.start : chunk.start + chunk.length]
            self.host_positions[row:end] = pos
            self.host_slots[row:end] = (
                table[pos // self.block_size] * slots_per_block + pos % self.block_size
            )
            row = end

    def check_writes(self) -> None:
        """Under the pool's probes, where this step's K/V goes, checked once on the host before
        the forward stores it (eager or graphs): a slot in a published, freed or unmapped block
        is a finding naming the chunk's request (probes/stores.py)."""
        if getattr(self.cache, "probe", None) is not None:
            # (the spans zipped from lists: a tuple built per chunk costs the host more)
            spans = list(zip(self.seqs, self.starts, self.seq_lens))
            Writers(self.cache, spans).check(self.host_slots)
        if self.guarded and getattr(self.cache, "provenance_sample", 0):
            # slot provenance: each slot a sequence reads was written for its own tokens, or
            # its prefix hit's (KVPool.check_provenance: a foreign_slot finding). The sweep
            # reads every slot of a sequence, so a sequence is swept at each prompt chunk and
            # at each decode that starts its block 1, 2, 4, 8, ... (about log2 of its blocks
            # sweeps while it decodes, not one a block), and once more as it finishes
            # (Engine._finish); a hit is checked at the hit by the pool itself
            bs, first, seqs = self.block_size, self.num_prefills, self.seqs
            decodes = zip(seqs[first:], self.starts[first:])
            # (the remainder first: a function call per decode costs the host more than this)
            swept = seqs[:first] + [s for s, p in decodes if p % bs == 0 and sweeps(p, bs)]
            if swept:
                self.cache.check_provenance(swept)

    @cached_property
    def seqs(self) -> list[Any]:
        """Each chunk's sequence, in batch order."""
        return [c.stream.seq for c in self.chunks]

    @cached_property
    def starts(self) -> list[int]:
        """Each chunk's first position, in batch order."""
        return [c.start for c in self.chunks]

    def audit(self, table: Any, rows: list[Chunk]) -> None:
        """Guard mode: the block table an eager step's kernels will read (a group's; the step
        graphs audit their whole static table themselves, graphs.StepGraphs) against the pool's
        tables of the chunks' sequences (KVPool.audit_block_table: a finding when they
        differ)."""
        audit = getattr(self.cache, "audit_block_table", None)
        if audit is not None:
            seqs, lengths = self.audit_rows(rows)
            audit(table, rows=seqs, lengths=lengths)

    @staticmethod
    def audit_rows(rows: list[Chunk]) -> tuple[list[Any], list[int]]:
        """The audit's rows: the chunks' sequences and the tokens each reads."""
        return [c.stream.seq for c in rows], [c.start + c.length for c in rows]

    def host_tables(self, rows: list[Chunk], width: int) -> np.ndarray:
        """Block tables [len(rows), width] of some chunks' sequences, -1 past each one's end."""
        tables = np.full((len(rows), max(width, 1)), -1, dtype=np.int32)
        for i, chunk in enumerate(rows):
            used = -(-(chunk.start + chunk.length) // self.block_size)
            tables[i, :used] = chunk.stream.seq.block_table[:used]
        return tables

    @cached_property
    def guard(self) -> dict[str, Tensor]:
        """Guard mode: the kernels' `block_state` and `errors` arguments ({} when off). A step
        the graphs run is given theirs instead (StepGraphs.forward)."""
        if not self.guarded:
            return {}
        return {
            "block_state": self.cache.block_state().to(self.device),
            "errors": kernels.new_error_buffer(device=self.device),
        }

    def _to_device(self, array: np.ndarray) -> Tensor:
        return torch.from_numpy(array).to(self.device)

    @cached_property
    def tokens(self) -> Tensor:
        return self._to_device(self.host_tokens)

    @cached_property
    def positions(self) -> Tensor:
        return self._to_device(self.host_positions)

    @cached_property
    def slot_mapping(self) -> Tensor:
        return self._to_device(self.host_slots)

    @cached_property
    def prefill(self) -> tuple[Tensor, Tensor]:
        """Block tables [n, max_blocks] (-1 padded) and total lengths [n] of the prompt chunks."""
        return self._group(0, self.num_prefills)

    @cached_property
    def decode(self) -> tuple[Tensor, Tensor]:
        """The same for the decodes."""
        return self._group(self.num_prefills, len(self.chunks))

    @cached_property
    def query_start_loc(self) -> Tensor:
        """Where each prompt chunk's tokens start in the packed batch, and the end: [n + 1]."""
        lengths = [c.length for c in self.chunks[: self.num_prefills]]
        return self._to_device(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))

    def _group(self, first: int, end: int) -> tuple[Tensor, Tensor]:
        lens = self.seq_lens[first:end]
        width = max((-(-n // self.block_size) for n in lens), default=0)
        tables = self.host_tables(self.chunks[first:end], width)
        if self.guarded:
            self.audit(tables, self.chunks[first:end])
        return self._to_device(tables), self._to_device(np.asarray(lens, dtype=np.int32))

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Store this step's K/V in the pool, then paged attention: [tokens, heads, head_dim]."""
        k_cache, v_cache = self.kv[layer, 0], self.kv[layer, 1]
        kernels.store_kv(
            k, v, k_cache, v_cache, self.slot_mapping, block_size=self.block_size, **self.guard
        )
        split = self.num_prefill_tokens
        outs = []
        if split:
            tables, lens = self.prefill
            outs.append(
                kernels.paged_prefill(
                    q[:split],
                    k_cache,
                    v_cache,
                    tables,
                    lens,
                    self.query_start_loc,
                    block_size=self.block_size,
                    # known here: without it the launch reads it back from the GPU
                    max_query_len=max(c.length for c in self.chunks[: self.num_prefills]),
                    **self.guard,
                )  # fmt: skip
            )
        if split < q.shape[0]:
            tables, lens = self.decode
            decode_lens = self.seq_lens[self.num_prefills :]
            outs.append(
                kernels.paged_decode(
                    q[split:],
                    k_cache,
                    v_cache,
                    tables,
                    lens,
                    block_size=self.block_size,
                    max_seq_len=max(decode_lens),
                    total_seq_len=sum(decode_lens),
                    **self.guard,
                )  # fmt: skip
            )
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def violations(self) -> list[dict[str, Any]]:
        """What the kernels' guard-mode checks recorded during this step (empty when off); reads
        the error buffer back at once (the engine copies it behind the step instead)."""
        if not self.guard:
            return []
        return kernels.decode_errors(self.guard["errors"])
