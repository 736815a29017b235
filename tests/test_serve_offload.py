"""serve.py --offload: each finished request's K/V is copied to host memory on a background
thread under a read lease, the request freed at once; the copies hold the request's K/V even
when its freed blocks would have gone to the next request first (the lease quarantines them)."""

from __future__ import annotations

import json
import os
import sys
import threading
import uuid
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from serve import main  # noqa: E402
from server.offload import Offloader  # noqa: E402

from kvscope.allocator.layout import BlockState  # noqa: E402

SMALL = ["--requests", "12", "--output-len", "2:6", "--rate", "0", "--no-progress"]


def test_serve_offloads_every_finished_request(capsys: pytest.CaptureFixture[str]) -> None:
    name = f"test-offload-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    assert main([*SMALL, "--json", "--offload", "--pool-name", name]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["failed"] == 0
    assert summary["extra"]["offload"]["requests"] == 12
    assert summary["extra"]["offload"]["bytes"] > 0
    assert summary["extra"]["cache_findings"] == 0


def test_an_offloaded_requests_blocks_are_not_handed_out_before_its_copy(make_pool) -> None:
    # GIVEN an offloader whose thread is busy, and a request whose K/V is known
    pool = make_pool(8)
    off = Offloader(pool)
    gate = threading.Event()
    off._queue.put(("busy", _Stall(gate)))
    seq = pool.allocate("r", list(range(12)))
    mine = list(seq.block_table)
    pool.kv[:, :, mine] = 7.0
    # WHEN it is leased for the copy and freed, and the pool is then filled and overwritten
    off.submit(seq)
    pool.free(seq)
    assert all(pool.view.blocks["state"][b] == BlockState.QUARANTINED for b in mine)
    other = pool.allocate("next", list(range(100, 100 + 5 * 4)))
    assert not set(other.block_table) & set(mine)
    pool.kv[:, :, other.block_table] = -1.0
    gate.set()
    off.close()
    # THEN the copy holds the request's own K/V, and the lease is gone
    assert bool((off.host["r"] == 7.0).all())
    assert pool.leases() == [] and pool.findings() == []


class _Stall:
    """A queue item in a lease's place that holds the offload thread at its release until
    `gate` is set (it copies no block)."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate
        self.blocks: list[int] = []

    def release(self) -> bool:
        self.gate.wait(30)
        return True
