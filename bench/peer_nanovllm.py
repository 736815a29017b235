"""nano-vllm's BlockManager, loaded from a checkout, on bench_pool.py's workloads.

nano-vllm is not on PyPI, and nothing of it is copied here. Get a checkout and the one package
its block manager needs beyond numpy, then name the checkout:

    git clone https://github.com/GeeeekExplorer/nano-vllm /tmp/nano-vllm
    pip install xxhash
    python bench/bench_pool.py --nano-vllm /tmp/nano-vllm

Three of its files run, unchanged: nanovllm/engine/block_manager.py, nanovllm/engine/sequence.py
and nanovllm/sampling_params.py. The package's own `__init__` (the LLM engine: torch,
transformers, flash-attn) is not run: `nanovllm` is registered as a bare package whose path is
the checkout's folder, which is all that `import nanovllm.engine.block_manager` needs.

Each workload calls the BlockManager and Sequence methods in the order nano-vllm's Scheduler
calls them (nanovllm/engine/scheduler.py): `can_allocate` then `allocate`; per decoded token
`append_token`, `can_append`, `may_append`, then `hash_blocks` once the token is computed;
`deallocate`. It has no fork.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any


def load(checkout: str) -> tuple[ModuleType, str]:
    """The checkout's `nanovllm.engine.block_manager` module and the checkout's commit."""
    root = Path(checkout).resolve()
    package_dir = root / "nanovllm"
    if not (package_dir / "engine" / "block_manager.py").is_file():
        raise SystemExit(f"bench_pool: error: no nanovllm/engine/block_manager.py under {root}")
    spec = importlib.util.spec_from_loader("nanovllm", loader=None, is_package=True)
    assert spec is not None
    package = importlib.util.module_from_spec(spec)
    package.__path__ = [str(package_dir)]
    sys.modules["nanovllm"] = package
    try:
        module = importlib.import_module("nanovllm.engine.block_manager")
    except ImportError as e:
        raise SystemExit(
            f"bench_pool: error: cannot import nano-vllm's BlockManager ({e})"
        ) from None
    return module, _commit(root)


def _commit(root: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() if done.returncode == 0 else "(not a git checkout)"


class NanoVllmPeer:
    """One BlockManager of `num_blocks` blocks, with a workload per method (rates per second)."""

    name = "nano-vllm"

    def __init__(self, module: ModuleType, num_blocks: int, block_size: int):
        # As LLMEngine does: the block size is a class attribute of Sequence.
        module.Sequence.block_size = block_size
        self.Sequence = module.Sequence
        self.bm = module.BlockManager(num_blocks, block_size)
        self.block_size = block_size

    def _admit(self, tokens: list[int]) -> Any:
        seq = self.Sequence(tokens)
        num_cached_blocks = self.bm.can_allocate(seq)
        assert num_cached_blocks >= 0
        self.bm.allocate(seq, num_cached_blocks)
        return seq

    def _computed(self, seq: Any, num_tokens: int) -> None:
        """The scheduler's postprocess once `num_tokens` more tokens' KV is written."""
        seq.num_scheduled_tokens = num_tokens
        self.bm.hash_blocks(seq)
        seq.num_cached_tokens += num_tokens
        seq.num_scheduled_tokens = 0

    def _decode(self, seq: Any, token: int) -> None:
        seq.append_token(token)
        assert self.bm.can_append(seq)
        self.bm.may_append(seq)

    def batch(self, n: int, tokens: list[int]) -> float:
        t = time.perf_counter()
        for i in range(n):
            tokens[0] = i
            self.bm.deallocate(self._admit(tokens))
        return 64 * n / (time.perf_counter() - t)

    def single(self, n: int) -> float:
        t = time.perf_counter()
        for i in range(n):
            self.bm.deallocate(self._admit([i, 1, 2]))
        return n / (time.perf_counter() - t)

    def append(self, n: int) -> float:
        t = time.perf_counter()
        seq = self._admit([1])
        for i in range(n):
            if seq.num_tokens >= 1024:
                self.bm.deallocate(seq)
                seq = self._admit([1])
            self._decode(seq, i)
        rate = n / (time.perf_counter() - t)
        self.bm.deallocate(seq)
        return rate

    def hit(self, n: int, prompt: list[int]) -> float:
        owner = self._admit(prompt)
        self._computed(owner, owner.num_tokens - owner.num_cached_tokens)
        expect = (len(prompt) - 1) // self.block_size * self.block_size
        t = time.perf_counter()
        for _ in range(n):
            seq = self._admit(prompt)
            assert seq.num_cached_tokens == expect
            self.bm.deallocate(seq)
        rate = n / (time.perf_counter() - t)
        self.bm.deallocate(owner)
        return rate

    def seqs(self, prompts: list[list[int]], decode: int, running: int) -> float:
        t = time.perf_counter()
        live: list[list[Any]] = []
        pending = iter(prompts)
        done = 0
        tok = 0
        while done < len(prompts):
            while len(live) < running:
                p = next(pending, None)
                if p is None:
                    break
                seq = self._admit(p)
                self._computed(seq, seq.num_tokens - seq.num_cached_tokens)
                live.append([seq, decode])
            for item in live:
                tok += 1
                self._decode(item[0], tok)
                self._computed(item[0], 1)
                item[1] -= 1
            for item in [x for x in live if x[1] == 0]:
                self.bm.deallocate(item[0])
                live.remove(item)
                done += 1
        return len(prompts) / (time.perf_counter() - t)

    def close(self) -> None:
        """Nothing to release: the manager is an in-process object."""
