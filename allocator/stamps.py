"""Digests of published blocks taken on the GPU, written into the blocks' records once their
answers are in (allocator/devicechecks.py reads them; docs/FORMAT.md "The native core").

A digest reaches a record only while the block is still published in the generation it was
taken in and has no digest of that generation yet: a block evicted, or digested twice, in the
meantime keeps its record as it is.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from kvscope.allocator import integrity
from kvscope.allocator.layout import CHUNK

if TYPE_CHECKING:
    from kvscope.allocator.pool import KVPool


def write_stamps(pool: KVPool, stamps: list[tuple[int, int, int]]) -> None:
    """(block, generation, kv_digest word) of each digest answered, into the records, a
    transaction per CHUNK blocks (the undo journal holds one operation's records): the C
    core's `write_digests` where it runs (the same writes, in a tenth of the host's time), else
    the Python path's below."""
    # one stamp per (block, generation): a block digested twice in one generation keeps its
    # first digest (Python's dict, not np.unique: a few dozen entries a settle)
    first: dict[tuple[int, int], int] = {}
    for key_and_word in stamps:
        first.setdefault(key_and_word[:2], key_and_word[2])
    items = list(first.items())
    b = pool.view.blocks

    def write(t: Any, ids: np.ndarray, gens: np.ndarray, words: np.ndarray) -> None:
        ok = (b["generation"][ids] == gens) & (b["indexed"][ids] == 1)
        ok &= ~integrity.has_digest(b, ids)
        sel = np.flatnonzero(ok)
        if len(sel) == 0:
            return
        pool.store.save(t, ids[sel])
        b["kv_digest"][ids[sel]] = words[sel]
        pool.store.seal(ids[sel])

    for i in range(0, len(items), CHUNK):
        part = items[i : i + CHUNK]
        id_list = [k[0] for k, _ in part]
        gen_list = [k[1] for k, _ in part]
        word_list = [w for _, w in part]
        core = pool._native
        if core is not None and core.write_digests(pool, id_list, gen_list, word_list) is not None:
            continue
        ids = np.array(id_list, np.int64)
        gens = np.array(gen_list, b.dtype["generation"])
        words = np.array(word_list, np.uint64)
        locks = pool.store.shard_locks_for(ids)
        pool._run(locks, functools.partial(write, ids=ids, gens=gens, words=words))
