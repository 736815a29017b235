"""A plain in-process block manager, nano-vllm style (deque of free ids, dict of hashes): the peer
that bench_pool.py measures beside the shared, journaled pool on the same workloads."""

from __future__ import annotations

from collections import deque


class Block:
    """One block: refcount, prefix hash and token ids."""

    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []


class PeerSeq:
    """A sequence: its tokens and block table."""

    __slots__ = ("tokens", "block_table", "num_cached_tokens")

    def __init__(self, tokens: list[int]):
        self.tokens = list(tokens)
        self.block_table: list[int] = []
        self.num_cached_tokens = 0


class BlockManager:
    """nano-vllm's BlockManager shape: allocate / deallocate / append with prefix caching."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    @staticmethod
    def compute_hash(token_ids: list[int], prefix: int = -1) -> int:
        return hash((prefix, *token_ids))

    def _allocate_block(self, block_id: int) -> Block:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.ref_count = 1
        block.hash = -1
        block.token_ids = []
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return block

    def _deallocate_block(self, block_id: int) -> None:
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def allocate(self, seq: PeerSeq) -> None:
        bs = self.block_size
        h = -1
        cache_miss = False
        n = -(-len(seq.tokens) // bs)
        for i in range(n):
            token_ids = seq.tokens[i * bs : (i + 1) * bs]
            h = self.compute_hash(token_ids, h) if len(token_ids) == bs else -1
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                cache_miss = True
            if cache_miss:
                if not self.free_block_ids:
                    raise MemoryError("out of blocks")
                block_id = self.free_block_ids[0]
                block = self._allocate_block(block_id)
            else:
                seq.num_cached_tokens += bs
                if block_id in self.used_block_ids:
                    block = self.blocks[block_id]
                    block.ref_count += 1
                else:
                    block = self._allocate_block(block_id)
            if h != -1:
                block.hash = h
                block.token_ids = token_ids
                self.hash_to_block_id[h] = block_id
            seq.block_table.append(block_id)

    def deallocate(self, seq: PeerSeq) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block_id)
        seq.block_table.clear()

    def append(self, seq: PeerSeq, token: int) -> None:
        seq.tokens.append(token)
        bs = self.block_size
        n = len(seq.tokens)
        table = seq.block_table
        if n % bs == 1:
            block_id = self.free_block_ids[0]
            self._allocate_block(block_id)
            table.append(block_id)
        elif n % bs == 0:
            last = self.blocks[table[-1]]
            prefix = self.blocks[table[-2]].hash if len(table) > 1 else -1
            token_ids = seq.tokens[-bs:]
            h = self.compute_hash(token_ids, prefix)
            last.hash = h
            last.token_ids = token_ids
            self.hash_to_block_id[h] = last.block_id

    def fork(self, seq: PeerSeq) -> PeerSeq:
        child = PeerSeq(seq.tokens)
        child.block_table = list(seq.block_table)
        for b in child.block_table:
            self.blocks[b].ref_count += 1
        return child
