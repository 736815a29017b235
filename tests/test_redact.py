"""`kvscope dump --redact`: no token id, prefix key or request id of the pool is left in the file,
and the redacted dump analyzes exactly as the original does."""

from __future__ import annotations

import json
import os
import signal

import numpy as np

from kvscope.allocator import KVPool
from kvscope.allocator.findings import Finding
from kvscope.cli import main
from kvscope.dumpfile import read_dump
from tests.journals import journal_save

# Distinctive values, so that finding their bytes in the dump cannot be a coincidence.
PROMPT = [913_000 + 37 * i for i in range(12)]
OTHER = [7_301_000 + 11 * i for i in range(9)]
DEAD = [5_550_000 + 3 * i for i in range(7)]
REQUESTS = ["zq-secret-alpha-0001", "zq-secret-beta-0002", "zq-secret-gamma-0003",
            "zq-secret-dead-0004", "zq-a-request-id-longer-than-32-bytes-0005"]  # fmt: skip


def _pairs(tokens: list[int], block_size: int = 4) -> list[bytes]:
    """Each two consecutive token ids of a prompt that share a block, as they lie in the block
    record (int32, little-endian)."""
    raw = np.asarray(tokens, np.int32).tobytes()
    return [raw[4 * i : 4 * i + 8] for i in range(len(tokens) - 1) if (i + 1) % block_size]


def _kinds(capsys, path) -> tuple[int, list[tuple[str, str, int | None]]]:
    code = main(["analyze", str(path), "--json"])
    rep = json.loads(capsys.readouterr().out)
    return code, sorted((f["kind"], f["severity"], f["block"]) for f in rep["findings"])


def test_redacted_dump_holds_no_token_prefix_key_or_request_id(capsys, make_pool, tmp_path, monkeypatch):  # fmt: skip
    # GIVEN a pool with the flight recorder on: a shared published prefix, a fork, an append, a
    # finding naming a request, and a dead process whose uncommitted journal saved a record
    monkeypatch.setenv("KVSCOPE_EVENTS", "1")
    pool = make_pool(48, max_clients=4)
    a = pool.allocate(REQUESTS[0], PROMPT)
    pool.mark_computed(a, len(PROMPT))
    b = pool.allocate(REQUESTS[1], PROMPT + OTHER[:2])
    pool.fork(b, REQUESTS[2])
    pool.append(a, OTHER[2:5])
    long_seq = pool.allocate(REQUESTS[4], OTHER)
    pool.report(
        Finding(
            "lock_held_too_long",
            f"request '{REQUESTS[4]}' waited",
            block=long_seq.block_table[0],
            request=REQUESTS[4][:32],
        )  # fmt: skip
    )
    pid = os.fork()
    if pid == 0:
        child = KVPool.attach(pool.name)
        seq = child.allocate(REQUESTS[3], DEAD)
        blk = seq.block_table[0]
        size = child.view.blocks.dtype.itemsize
        journal_save(child, child.view.offsets["blocks"] + blk * size, size)
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    keys = pool.view.blocks["prefix_hash"]
    keys = [int(k).to_bytes(8, "little") for k in keys[keys != 0]]
    assert len(keys) >= 3
    plain, redacted = tmp_path / "plain.kvd", tmp_path / "redacted.kvd"
    assert main(["dump", pool.name, "-o", str(plain)]) == 0
    # WHEN it is dumped with --redact
    assert main(["dump", pool.name, "-o", str(redacted), "--redact"]) == 0
    capsys.readouterr()
    # THEN the plain dump holds every value the scan looks for (the scan can see them) ...
    raw, red = plain.read_bytes(), redacted.read_bytes()
    secrets = {f"tokens {t!r}": t for t in _pairs(PROMPT) + _pairs(OTHER) + _pairs(DEAD)}
    secrets.update({f"prefix key {k.hex()}": k for k in keys})
    secrets.update({f"request {r}": r.encode()[:32] for r in REQUESTS})
    assert all(v in raw for v in secrets.values()), [k for k, v in secrets.items() if v not in raw]
    # ... and the redacted one none of them, anywhere in its bytes
    assert [k for k, v in secrets.items() if v in red] == []
    # AND it analyzes as the original: the same findings, on the same blocks
    assert _kinds(capsys, redacted) == _kinds(capsys, plain)
    view, dh = read_dump(redacted)
    assert int(dh["flags"]) & 2
    # equal request ids stay equal: the fork's blocks and the sequence table agree
    seqs = view.seqs
    reqs = {bytes(r) for r in seqs["request"][seqs["state"] != 0]}
    assert len(reqs) == 5 and all(r.startswith(b"r~") for r in reqs)
    assert bytes(view.blocks["request"][a.block_table[0]]) in reqs
