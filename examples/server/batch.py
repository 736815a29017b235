"""One engine step packed for the model, and its attention through the kvscope kernels.

Prompt chunks come first, then decodes; every new token's K/V is stored into its pool slot
with `store_kv`, then `paged_prefill` attends the chunks over their cached prefix and
`paged_decode` the single tokens over their whole sequence, all on the pool's KV tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kvscope import kernels

from .scheduler import Chunk


class Batch:
    """Token ids, positions, slots and block tables of one step, on the model's device."""

    def __init__(self, chunks: list[Chunk], cache: Any, device: torch.device | str) -> None:
        assert chunks
        self.kv = cache.kv
        self.block_size = cache.config.block_size
        # Guard mode: the kernels check every block-table entry and slot against the pool's
        # block states and record violations here instead of reading or writing out of bounds.
        self.guard: dict[str, Tensor] = {}
        if getattr(cache.config, "guard", False) and hasattr(cache, "block_state"):
            self.guard = {
                "block_state": cache.block_state().to(device),
                "errors": kernels.new_error_buffer(device=device),
            }
        slots_per_block = cache.slots_per_block
        prefills = [c for c in chunks if c.length > 1]
        decodes = [c for c in chunks if c.length == 1]
        self.chunks = prefills + decodes
        self.num_prefill_tokens = sum(c.length for c in prefills)
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for chunk in self.chunks:
            seq = chunk.stream.seq
            table = seq.block_table
            for pos in range(chunk.start, chunk.start + chunk.length):
                tokens.append(seq.tokens[pos])
                positions.append(pos)
                slots.append(
                    table[pos // self.block_size] * slots_per_block + pos % self.block_size
                )
        # index of each chunk's last token in the packed batch: where its logits come from
        ends = torch.tensor([c.length for c in self.chunks]).cumsum(0)
        self.last_rows = (ends - 1).tolist()
        self.tokens = torch.tensor(tokens, dtype=torch.long, device=device)
        self.positions = torch.tensor(positions, dtype=torch.long, device=device)
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
        self.prefill = self._group(prefills, device)
        self.decode = self._group(decodes, device)
        if prefills:
            starts = [0] + torch.tensor([c.length for c in prefills]).cumsum(0).tolist()
            self.query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)

    def _group(self, chunks: list[Chunk], device: torch.device | str) -> tuple[Tensor, Tensor]:
        """Block tables [n, max_blocks] (-1 padded) and total lengths [n] of some chunks."""
        lengths = [c.start + c.length for c in chunks]
        width = max((-(-n // self.block_size) for n in lengths), default=0)
        tables = torch.full((len(chunks), max(width, 1)), -1, dtype=torch.int32)
        for row, (chunk, n) in enumerate(zip(chunks, lengths, strict=True)):
            used = -(-n // self.block_size)
            tables[row, :used] = torch.tensor(chunk.stream.seq.block_table[:used])
        seq_lens = torch.tensor(lengths, dtype=torch.int32)
        return tables.to(device), seq_lens.to(device)

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
                    **self.guard,
                )  # fmt: skip
            )
        if split < q.shape[0]:
            tables, lens = self.decode
            outs.append(
                kernels.paged_decode(
                    q[split:],
                    k_cache,
                    v_cache,
                    tables,
                    lens,
                    block_size=self.block_size,
                    **self.guard,
                )
            )
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def violations(self) -> list[dict[str, Any]]:
        """What the kernels' guard-mode checks recorded during this step (empty when off)."""
        if not self.guard:
            return []
        return kernels.decode_errors(self.guard["errors"])
