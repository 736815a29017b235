"""Shared fixtures: unique pool names, cleaned up after each test."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import uuid
from pathlib import Path

import pytest
import torch

from kvscope.allocator import KVPool, PoolConfig, faults
from kvscope.allocator.segment import data_path, segment_path

ROOT = str(Path(__file__).resolve().parents[1])


class _InstalledKernels(importlib.abc.MetaPathFinder):
    """Finds the top-level name `kernels` anywhere on sys.path but the repository's root.

    `python -m pytest` puts the root first on sys.path (the tests import `tests.*`), and the
    root's kernels/ folder, installed as `kvscope.kernels`, would then stand for the PyPI package
    `kernels` that transformers 5 requires and imports when it is imported (ImportError: cannot
    import name 'CUDAProperties' from 'kernels')."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "kernels":
            return None
        elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != ROOT]
        return importlib.machinery.PathFinder.find_spec(fullname, elsewhere)


sys.meta_path.insert(0, _InstalledKernels())


def _cleanup(name: str) -> None:
    for p in (segment_path(name), data_path(name)):
        if os.path.lexists(p):
            os.unlink(p)


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module's tests (the example engine's tiny matmuls on 2 busy
    cores run ~50x slower with 2 OpenMP threads than with 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def pool_name():
    """A fresh pool name; its files are removed after the test."""
    name = f"test-{uuid.uuid4().hex[:10]}"
    yield name
    _cleanup(name)


@pytest.fixture
def probes(monkeypatch):
    """The probes `kvscope run` turns on (guard mode comes with each pool's config); no fault
    left armed afterwards."""
    for name in ("LEAKS", "MAGIC", "EVENTS", "OWNERSHIP", "DIGEST"):
        monkeypatch.setenv(f"KVSCOPE_{name}", "1")
    yield
    faults.configure(None)


@pytest.fixture
def make_pool(pool_name):
    """Factory: make_pool(num_blocks=..., **config) -> KVPool (closed and unlinked afterwards)."""
    made: list[KVPool] = []

    def make(num_blocks: int = 64, **kw) -> KVPool:
        kw.setdefault("block_size", 4)
        kw.setdefault("head_dim", 8)
        kw.setdefault("num_layers", 1)
        kw.setdefault("dtype", "float32")
        pool = KVPool.create(
            pool_name if not made else f"{pool_name}-{len(made)}",
            PoolConfig(num_blocks=num_blocks, **kw),
        )
        made.append(pool)
        return pool

    yield make
    for p in made:
        if not p.closed and p.pid == os.getpid():
            p.close()
        _cleanup(p.name)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # the marker, not `"gpu" in item.keywords`: keywords hold the checkout's folder name
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
