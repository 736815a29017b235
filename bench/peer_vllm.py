"""vLLM's v1 BlockPool, installed at benchmark time, on bench_pool.py's workloads.

Install the wheel without its dependencies into a folder of its own, with the packages that
`import vllm.v1.core.block_pool` reaches (bench/vllm_import_deps.txt), then name the folder:

    pip install --no-deps --target /tmp/vllm-peer vllm==0.33.0 -r bench/vllm_import_deps.txt
    python bench/bench_pool.py --vllm /tmp/vllm-peer

Why that many packages: block_pool.py imports vllm.distributed.kv_events, which imports
vllm.config (the engine's whole configuration: pydantic, transformers, the quantization
registry), and vllm.v1.core.kv_cache_utils, which imports vllm.v1.request (torch, the
structured-output backends xgrammar and llguidance, the OpenAI-compatible parsers). None of it runs a GPU: torch is kvscope's own CPU build, no CUDA
is initialised and vLLM's compiled kernels (`vllm._C`) are not loaded. Importing takes 20-40 s
on the 2-core machine (bench_pool.py prints it), before anything is timed.

BlockPool is the block level of vLLM's KV cache: it hands out and frees blocks, looks up and
caches full blocks by hash, and evicts LRU cached blocks. The per-request bookkeeping above it
(KVCacheManager: a request's block list, how many blocks are cached) is a plain list and an int
here, so the vLLM column carries less per-request work than vLLM itself does. Each workload
calls BlockPool in the order vLLM's FullAttentionManager does: `get_cached_block` for each
full-block hash of the prompt up to the first miss (at most `(len - 1) // block_size`),
`touch` on the hits, `get_new_blocks` for the rest, `cache_full_blocks` once blocks are full
and computed, `free_blocks` of the reversed block list. Block hashes are vLLM's own
`hash_block_tokens` with the default prefix-caching hash (`sha256`), chained per block as a
Request's block hasher does; only the hashes a step reads are computed (a Request hashes every
full block of its prompt when it is made). `cache_full_blocks` takes a request for its
`block_hashes` list alone while KV events are off; a two-field stand-in passes it.

BlockPool has no fork and no per-token append (a decoded token is `get_new_blocks(1)` once per
block, measured by the single-pairs row): those rows are n/a.
"""

from __future__ import annotations

import importlib
import sys
import time
from types import ModuleType
from typing import Any


def load(target: str | None) -> tuple[ModuleType, ModuleType, str]:
    """vllm.v1.core.block_pool, vllm.v1.core.kv_cache_utils and vLLM's version."""
    if target:
        sys.path.insert(0, target)
    try:
        hashing = importlib.import_module("vllm.utils.hashing")
        block_pool = importlib.import_module("vllm.v1.core.block_pool")
    except ImportError as e:
        raise SystemExit(
            f"bench_pool: error: cannot import vLLM's BlockPool ({e}); see {__file__}"
        ) from None
    utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    vllm = importlib.import_module("vllm")
    # As EngineCore does before any request is hashed.
    utils.init_none_hash(hashing.get_hash_fn_by_name("sha256"))
    return block_pool, utils, vllm.__version__


class _RequestHashes:
    """What `cache_full_blocks` reads of a Request while KV events are off."""

    __slots__ = ("block_hashes", "tokens")

    def __init__(self, tokens: list[int]):
        self.tokens = list(tokens)
        self.block_hashes: list[Any] = []


class VllmPeer:
    """One BlockPool of `num_blocks` usable blocks, with a workload per method (rates per second)."""

    name = "vLLM BlockPool"

    def __init__(self, modules: tuple[ModuleType, ModuleType], num_blocks: int, block_size: int):
        block_pool, utils = modules
        # Block 0 is vLLM's null block: one more gives the same number of usable blocks.
        self.pool = block_pool.BlockPool(num_blocks + 1, True, block_size)
        self.hash_fn = importlib.import_module("vllm.utils.hashing").get_hash_fn_by_name("sha256")
        self.hash_block_tokens = utils.hash_block_tokens
        self.block_size = block_size
        self.group_ids = [0]

    def _hash_next(self, req: _RequestHashes) -> None:
        """Hash the request's next full block, chained on the one before."""
        bs = self.block_size
        i = len(req.block_hashes)
        parent = req.block_hashes[-1] if i else None
        req.block_hashes.append(
            self.hash_block_tokens(self.hash_fn, parent, req.tokens[i * bs : (i + 1) * bs])
        )

    def _admit(self, req: _RequestHashes) -> tuple[list[Any], int]:
        """The request's blocks, hits first, and how many hit."""
        pool = self.pool
        hits: list[Any] = []
        for i in range((len(req.tokens) - 1) // self.block_size):
            if len(req.block_hashes) <= i:
                self._hash_next(req)
            cached = pool.get_cached_block(req.block_hashes[i], self.group_ids)
            if not cached:
                break
            hits.append(cached[0])
        pool.touch(hits)
        need = -(-len(req.tokens) // self.block_size) - len(hits)
        return hits + pool.get_new_blocks(need), len(hits)

    def _publish(self, req: _RequestHashes, blocks: list[Any], num_cached: int) -> int:
        """Cache the full blocks after `num_cached`; the new number of cached blocks."""
        num_full = len(req.tokens) // self.block_size
        while len(req.block_hashes) < num_full:
            self._hash_next(req)
        self.pool.cache_full_blocks(req, blocks, num_cached, num_full, self.block_size, 0)
        return num_full

    def batch(self, n: int, tokens: list[int]) -> float:
        pool = self.pool
        t = time.perf_counter()
        for i in range(n):
            tokens[0] = i
            blocks, _ = self._admit(_RequestHashes(tokens))
            pool.free_blocks(reversed(blocks))
        return 64 * n / (time.perf_counter() - t)

    def single(self, n: int) -> float:
        pool = self.pool
        t = time.perf_counter()
        for i in range(n):
            blocks, _ = self._admit(_RequestHashes([i, 1, 2]))
            pool.free_blocks(reversed(blocks))
        return n / (time.perf_counter() - t)

    def hit(self, n: int, prompt: list[int]) -> float:
        owner = _RequestHashes(prompt)
        owner_blocks, num_cached = self._admit(owner)
        self._publish(owner, owner_blocks, num_cached)
        expect = (len(prompt) - 1) // self.block_size
        t = time.perf_counter()
        for _ in range(n):
            blocks, num_hits = self._admit(_RequestHashes(prompt))
            assert num_hits == expect
            self.pool.free_blocks(reversed(blocks))
        rate = n / (time.perf_counter() - t)
        self.pool.free_blocks(reversed(owner_blocks))
        return rate

    def seqs(self, prompts: list[list[int]], decode: int, running: int) -> float:
        pool = self.pool
        bs = self.block_size
        t = time.perf_counter()
        # [request, blocks, cached blocks, tokens left]
        live: list[list[Any]] = []
        pending = iter(prompts)
        done = 0
        tok = 0
        while done < len(prompts):
            while len(live) < running:
                p = next(pending, None)
                if p is None:
                    break
                req = _RequestHashes(p)
                blocks, num_cached = self._admit(req)
                live.append([req, blocks, self._publish(req, blocks, num_cached), decode])
            for item in live:
                req, blocks = item[0], item[1]
                tok += 1
                req.tokens.append(tok)
                if len(blocks) * bs < len(req.tokens):
                    blocks.extend(pool.get_new_blocks(1))
                if len(req.tokens) % bs == 0:
                    item[2] = self._publish(req, blocks, item[2])
                item[3] -= 1
            for item in [x for x in live if x[3] == 0]:
                pool.free_blocks(reversed(item[1]))
                live.remove(item)
                done += 1
        return len(prompts) / (time.perf_counter() - t)

    def close(self) -> None:
        """Nothing to release: the pool is an in-process object."""
