"""The static baseline: each request reserves `max_len` contiguous slots at admission.

This is the classic layout that paging replaces. It has the subset of the `KVPool` API the
engine uses, over a private KV tensor of the same shape, so the same engine and kernels serve
from it: a reservation is a run of consecutive blocks, its block table `[start, start + 1, ...]`.
No prefix sharing, no copy-on-write (a fork copies), no preemption (nothing grows past its
reservation), and a first-fit free list whose holes are the external fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.allocator import PoolExhausted


@dataclass
class StaticSequence:
    """A request's reservation: its tokens and the consecutive blocks it holds."""

    request_id: str
    tokens: list[int]
    block_table: list[int]
    num_cached_tokens: int = 0
    state: str = "running"

    @property
    def num_tokens(self) -> int:
        """Tokens stored in the reservation."""
        return len(self.tokens)


@dataclass
class StaticGeometry:
    """Shape of the private KV tensor (the fields of `PoolConfig` the engine reads)."""

    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"


class StaticCache:
    """Contiguous `max_len` reservations in a KV tensor shaped like the pool's."""

    def __init__(self, config: StaticGeometry, max_len: int) -> None:
        assert max_len >= 1
        self.config = config
        self.max_len = max_len
        self.slots_per_block = config.block_size
        self.blocks_per_seq = -(-max_len // config.block_size)
        # [layers, 2, blocks, slots, kv_heads, head_dim], as pool.kv
        self.kv = torch.zeros(
            config.num_layers,
            2,
            config.num_blocks,
            config.block_size,
            config.num_kv_heads,
            config.head_dim,
            dtype=config.dtype,
            device=config.device,
        )
        # free extents start -> length, coalesced on release
        self.free_extents: dict[int, int] = {0: config.num_blocks}
        self.seqs: dict[str, StaticSequence] = {}
        self.num_admission_failures = 0
        self.num_external_failures = 0

    def allocate(self, request_id: str, prompt: list[int]) -> StaticSequence:
        """Reserve `max_len` slots for a new request and store its prompt tokens."""
        assert request_id not in self.seqs, f"duplicate request {request_id}"
        if len(prompt) > self.max_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens is longer than max_len {self.max_len}"
            )
        seq = StaticSequence(request_id, list(prompt), self._reserve())
        self.seqs[request_id] = seq
        return seq

    def append(self, seq: StaticSequence, tokens: list[int]) -> list[tuple[int, int]]:
        """Store more tokens inside the reservation; never copies."""
        assert seq.num_tokens + len(tokens) <= self.max_len, "sequence grew past max_len"
        seq.tokens.extend(tokens)
        return []

    def fork(self, seq: StaticSequence, request_id: str) -> StaticSequence:
        """A copy of `seq` in a reservation of its own (the static layout cannot share)."""
        assert request_id not in self.seqs
        child = StaticSequence(request_id, list(seq.tokens), self._reserve())
        used = -(-seq.num_tokens // self.config.block_size)
        src, dst = seq.block_table[:used], child.block_table[:used]
        self.kv[:, :, dst] = self.kv[:, :, src]
        self.seqs[request_id] = child
        return child

    def free(self, seq: StaticSequence) -> None:
        """Release the reservation of a finished request."""
        assert self.seqs.pop(seq.request_id) is seq, "free of an unknown sequence"
        self._release(seq.block_table[0], len(seq.block_table))
        seq.block_table = []
        seq.state = "finished"

    def abort(self, seq: StaticSequence) -> None:
        """Release the reservation of a request that did not finish."""
        self.free(seq)
        seq.state = "aborted"

    def set_state(self, seq: StaticSequence, state: str) -> None:
        """Record the state; a static reservation is never taken back."""
        assert state in ("running", "waiting")
        seq.state = state

    def resume(self, seq: StaticSequence) -> int:
        """Never needed: nothing is preempted in the static layout."""
        raise AssertionError("static reservations are never preempted")

    def mark_computed(self, seq: StaticSequence, num_tokens: int) -> None:
        """Nothing to publish: the static layout has no prefix index."""

    def mark_computed_many(self, seqs: list[StaticSequence], num_tokens: list[int]) -> None:
        """Nothing to publish (mark_computed)."""

    def block_table(self, seq: StaticSequence) -> list[int]:
        """The reservation's blocks."""
        return list(seq.block_table)

    def stats(self) -> dict[str, int]:
        """Block counts, and how often admission failed for lack of one large enough hole."""
        num_free = sum(self.free_extents.values())
        return {
            "num_blocks": self.config.num_blocks,
            "num_free": num_free,
            "num_allocated": self.config.num_blocks - num_free,
            "largest_free_extent": max(self.free_extents.values(), default=0),
            "num_admission_failures": self.num_admission_failures,
            "num_external_failures": self.num_external_failures,
        }

    def check(self) -> list[dict[str, object]]:
        """Findings: reservations that overlap each other or a free extent (none when healthy)."""
        owner = [-1] * self.config.num_blocks
        findings: list[dict[str, object]] = []
        extents = [(s.block_table[0], len(s.block_table), s.request_id) for s in self.seqs.values()]
        extents += [(start, n, "") for start, n in self.free_extents.items()]
        for i, (start, n, request) in enumerate(extents):
            for block in range(start, start + n):
                if owner[block] != -1:
                    findings.append({"kind": "double_free", "block": block, "request": request})
                owner[block] = i
        return findings

    def close(self) -> None:
        """Nothing to unmap."""

    def unlink(self) -> None:
        """Nothing to remove."""

    def _reserve(self) -> list[int]:
        """First fit: the lowest free extent that holds a whole reservation."""
        need = self.blocks_per_seq
        for start in sorted(self.free_extents):
            length = self.free_extents[start]
            if length >= need:
                del self.free_extents[start]
                if length > need:
                    self.free_extents[start + need] = length - need
                return list(range(start, start + need))
        num_free = sum(self.free_extents.values())
        self.num_admission_failures += 1
        if num_free >= need:
            self.num_external_failures += 1
        raise PoolExhausted(need, num_free, 0, self.config.num_blocks - num_free, {})

    def _release(self, start: int, length: int) -> None:
        """Return an extent, merging it with free neighbours."""
        end = start + length
        if end in self.free_extents:
            length += self.free_extents.pop(end)
        for other, n in list(self.free_extents.items()):
            if other + n == start:
                del self.free_extents[other]
                start, length = other, n + length
                break
        self.free_extents[start] = length
