"""Decode steps replayed as CUDA graphs: one captured forward per batch size.

A decode-only step of a large model launches about 30 kernels per layer from Python; at a batch
of a dozen sequences the GPU finishes each one faster than Python issues the next, so the step
is as long as its launches. A CUDA graph replays all of them from one call.

    graphs = DecodeGraphs(model, cache, max_batch=12, max_len=1152)   # captures on CUDA
    hidden = graphs.forward(batch)        # None: not a decode-only step that fits; run eagerly

Every input lives in a static buffer that the captured kernels read: a step copies its tokens,
positions, slots, block tables and lengths in and replays. Block tables are padded with -1 to
`max_len`'s width (the decode kernel reads no entry past a sequence's length). On the CPU
nothing is captured: the same static-buffer forward runs eagerly, so the tests check the
buffers' bookkeeping against the ordinary path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from kvscope import kernels

from .batch import Batch
from .model import LlamaModel


class DecodeGraphs:
    """Static decode inputs and, on CUDA, one captured model forward per batch size."""

    def __init__(self, model: LlamaModel, cache: Any, max_batch: int, max_len: int) -> None:
        assert max_batch >= 1 and max_len >= 1
        self.model = model
        self.kv = cache.kv
        self.block_size = cache.config.block_size
        self.slots_per_block = cache.slots_per_block
        self.max_batch = max_batch
        self.width = -(-max_len // self.block_size)
        device = model.lm_head.weight.device
        self.device = device
        self.tokens = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        # -1: store nothing (the capture's own forward must not write the pool)
        self.slots = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.tables = torch.zeros(max_batch, self.width, dtype=torch.int32, device=device)
        self.lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        # batch size -> (graph, its output hidden states)
        self.graphs: dict[int, tuple[Any, Tensor]] = {}
        # steps served from the static buffers, and how many of them were graph replays
        self.num_forwards = 0
        self.num_replays = 0
        if device.type == "cuda":
            self._capture_all()

    def forward(self, batch: Batch) -> Tensor | None:
        """Hidden states [n, hidden] of a decode-only `batch`, or None when it does not fit."""
        n = len(batch.chunks)
        if batch.num_prefill_tokens or batch.guard or n > self.max_batch:
            return None
        tables, lens = batch.decode
        if tables.shape[1] > self.width:
            return None
        self.tokens[:n].copy_(batch.tokens)
        self.positions[:n].copy_(batch.positions)
        self.slots[:n].copy_(batch.slot_mapping)
        self.tables[:n].fill_(-1)
        self.tables[:n, : tables.shape[1]].copy_(tables)
        self.lens[:n].copy_(lens)
        self.num_forwards += 1
        if n in self.graphs:
            graph, out = self.graphs[n]
            graph.replay()
            self.num_replays += 1
            return out
        return self._forward(n)

    def _forward(self, n: int) -> Tensor:
        """The model over the first `n` rows of the static buffers."""
        return self.model(self.tokens[:n], self.positions[:n], self._attend(n))

    def _attend(self, n: int) -> Callable[[int, Tensor, Tensor, Tensor], Tensor]:
        """Store K/V into the pool, then paged decode, over the static buffers' first `n` rows."""
        slots, tables, lens = self.slots[:n], self.tables[:n], self.lens[:n]
        max_seq_len = self.width * self.block_size

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            k_cache, v_cache = self.kv[layer, 0], self.kv[layer, 1]
            kernels.store_kv(k, v, k_cache, v_cache, slots, block_size=self.block_size)
            return kernels.paged_decode(
                q, k_cache, v_cache, tables, lens,
                block_size=self.block_size, max_seq_len=max_seq_len,
            )  # fmt: skip

        return attend

    def _capture_all(self) -> None:
        """Capture every batch size, largest first so the smaller ones reuse its memory."""
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for n in range(self.max_batch, 0, -1):
            # Warm up off the capture (Triton compiles, cuBLAS picks its kernels), on a side
            # stream as torch's graph docs ask.
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward(n)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(n)
            self.graphs[n] = (graph, out)
        torch.cuda.synchronize(self.device)
