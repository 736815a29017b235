"""A small serving engine written from docs/POOL.md alone, as a user would, with one bug planted
on request (tests/test_user_engine.py runs it under `kvscope run`).

Every request starts with the same 40-token system prompt; a request may ask for two samples
(fork); a client may disconnect (abort); a second process, started with spawn, serves requests
of its own. K/V is written with `kvscope.kernels.store_kv`, told the request it writes for
(`kvscope.probes.stores.Writers`), except the late write of the stale-table bug, which goes
around it; copy-on-write copies are made with `kvscope.kernels.copy_blocks`, told the pool
(`pool=`), except the one the skip-copy bug skips.

    python tests/user_engine.py POOL BUG      BUG: none, exception, worker, double-free,
                                                   contiguous, stale-table, whole-prompt,
                                                   skip-copy

It prints one JSON line of facts the test checks kvscope's findings against: the line of each
`# SITE:` marker is found by the test in this file's text.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys

import torch

from kvscope.allocator import KVPool, PoolConfig, PoolError
from kvscope.kernels import copy_blocks, store_kv
from kvscope.probes.stores import Writers

BLOCK_SIZE, HEADS, DIM, LAYERS = 4, 2, 8, 2
SYSTEM = list(range(1000, 1040))  # the 40-token system prompt every request starts with
CONFIG = PoolConfig(
    num_blocks=48,
    block_size=BLOCK_SIZE,
    num_layers=LAYERS,
    num_kv_heads=HEADS,
    head_dim=DIM,
    dtype="float32",
)


def kv_of(tokens: list[int], positions: list[int]) -> torch.Tensor:
    """The model's K (and V: the same, negated) of tokens at positions: [n, heads, dim]."""
    t = torch.tensor(tokens, dtype=torch.float32)[:, None, None]
    p = torch.tensor(positions, dtype=torch.float32)[:, None, None]
    return torch.sin(t * 0.01 + p * 0.1 + torch.arange(HEADS * DIM).view(1, HEADS, DIM))


class Engine:
    """Prefill, decode, finish on a shared pool."""

    def __init__(self, pool: KVPool, bug: str):
        self.pool = pool
        self.bug = bug
        # Which request allocated each block, as far as this engine knows.
        self.allocated_by: dict[int, str] = {}
        # Blocks the contiguous-prefill bug wrote into that were not the request's own.
        self.strays: dict[int, str] = {}
        # The request whose store landed in each of those blocks first.
        self.stray_writers: dict[int, str] = {}

    def write(self, tokens: list[int], positions: list[int], slots: list[int], seq=None) -> None:
        """Store the K/V of tokens at positions into slots, for `seq` (None: told no one)."""
        k = kv_of(tokens, positions)
        mapping = torch.tensor(slots, dtype=torch.int64)
        writers = (
            None if seq is None else Writers(self.pool, [(seq, positions[0], positions[-1] + 1)])
        )
        for layer in range(LAYERS):
            kc, vc = self.pool.kv[layer, 0], self.pool.kv[layer, 1]
            store_kv(k, -k, kc, vc, mapping, block_size=BLOCK_SIZE, writers=writers)  # SITE:store

    def admit(self, rid: str, prompt: list[int]):
        seq = self.pool.allocate(rid, prompt)  # SITE:admit
        for blk in seq.block_table[seq.num_cached_tokens // BLOCK_SIZE :]:
            self.allocated_by[blk] = rid
        self.prefill(seq)
        return seq

    def prefill(self, seq) -> None:
        start, end = seq.num_cached_tokens, len(seq.tokens)
        if self.bug == "whole-prompt":
            # The bug: the whole prompt stored, the cached prefix blocks it hit included.
            start = 0
        positions = list(range(start, end))
        if self.bug == "contiguous":
            # The bug: the sequence's blocks taken to be contiguous from its first one.
            spb = self.pool.slots_per_block
            slots = [seq.block_table[0] * spb + p for p in positions]
            mine = seq.block_table[start // BLOCK_SIZE :]
            for s in slots:
                blk = s // spb
                if blk not in mine and blk in self.allocated_by:
                    self.strays.setdefault(blk, self.allocated_by[blk])
                    self.stray_writers.setdefault(blk, seq.request_id)
        else:
            slots = self.pool.slot_mapping(seq, start, end)
        self.write(seq.tokens[start:end], positions, slots, seq)
        self.pool.mark_computed(seq, end)

    def decode(self, seq, token: int) -> None:
        copies = self.pool.append(seq, [token])  # SITE:append
        if copies and self.bug == "skip-copy" and seq.request_id == "r3":
            # The bug: the first sample of the second forked request goes on without the
            # copy-on-write copy it was given; its new block holds none of the positions
            # before the token written next.
            copies = []
        if copies:
            pairs = torch.tensor(copies, dtype=torch.int64)
            copy_blocks(self.pool.kv, pairs[:, 0], pairs[:, 1], pool=self.pool)
        for blk in seq.block_table:
            self.allocated_by.setdefault(blk, seq.request_id)
        n = len(seq.tokens)
        self.write([token], [n - 1], self.pool.slot_mapping(seq, n - 1, n), seq)


def serve(engine: Engine, rid: str, suffix: list[int], n: int = 1, cancel: bool = False):
    """One request: prefill, fork for n=2, three decode steps, free (or abort)."""
    pool, bug = engine.pool, engine.bug
    seq = engine.admit(rid, SYSTEM + suffix)
    seqs = [seq] + [pool.fork(seq, f"{rid}#{i}") for i in range(1, n)]
    for step in range(3):
        for i, s in enumerate(seqs):
            if bug == "exception" and rid == "r2" and step == 1:
                raise ValueError("the client sent garbage")
            engine.decode(s, 7 + step + i)
    if cancel:
        for s in seqs:
            pool.abort(s)
        return
    table = pool.block_table(seq)
    for s in seqs:
        pool.free(s)
    if bug == "double-free" and rid == "r2":
        try:
            pool.free(seq)  # SITE:second-free
        except PoolError:
            pass
    if bug == "stale-table" and rid == "r2":
        # A late token of the finished request, written through the table kept from before,
        # by a store told no writer (around the store check).
        pos = len(seq.tokens)
        slot = table[pos // BLOCK_SIZE] * pool.slots_per_block + pos % BLOCK_SIZE
        engine.write([99], [pos], [slot])
        engine.strays[table[pos // BLOCK_SIZE]] = rid


def worker(name: str) -> None:
    """The second process: serves two requests and never frees its last one."""
    pool = KVPool.attach(name)
    done = pool.allocate("w0", SYSTEM + [5, 6, 7])
    pool.free(done)
    pool.allocate("w1", SYSTEM + [8, 9, 10, 11, 12])  # SITE:worker-allocate
    # The bug: the worker returns without freeing w1 (or closing the pool).


def main(name: str, bug: str) -> int:
    pool = KVPool.create(name, CONFIG)
    engine = Engine(pool, bug)
    failed = []
    for i, (suffix, n, cancel) in enumerate(
        [([1, 2, 3], 1, False), ([4, 5, 6, 7, 8], 2, False), ([9, 10], 1, False),
         ([11, 12, 13], 2, False), ([14, 15, 16, 17], 1, True), ([18, 19, 20], 1, False)]
    ):  # fmt: skip
        try:
            serve(engine, f"r{i}", suffix, n, cancel)
        except ValueError:
            # The bug on this path: the request's sequences are never freed.
            failed.append(f"r{i}")
    if bug == "worker":
        proc = mp.get_context("spawn").Process(target=worker, args=(name,))
        proc.start()
        proc.join()
    facts = {"strays": engine.strays, "stray_writers": engine.stray_writers, "failed": failed}
    print(json.dumps(facts), flush=True)
    pool.close()
    pool.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
