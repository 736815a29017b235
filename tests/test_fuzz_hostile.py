"""Hostile segments and dumps: whatever the bytes, `analyze` and `check` answer 0, 1 or 2.

GIVEN a real pool (sequences, cached prefix blocks, events, recorded findings, a dead process
that left a journal), its dump and a raw copy of its segment, WHEN seeded mutations -- bit
flips, truncations, and huge or out-of-range values written into header geometry and into
records, with their checksums recomputed so that they pass as sealed -- are analyzed as dump
files, as raw segment copies and as live pools (`check`, `check --repair`), THEN every run ends
with exit code 0, 1 or 2, exit 2 is exactly one `kvscope: error:` line, no exception escapes,
and each input stays inside a time and a memory bound.

The runs happen in one worker process (tests/fuzz_worker.py) under RLIMIT_AS, each under an
interval timer, so a hang or an unbounded allocation is a failure, not a stuck suite.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import numpy as np
import pytest

from kvscope.allocator import KVPool, PoolConfig
from kvscope.allocator.checksums import block_checksums, header_checksum
from kvscope.allocator.geometry import BOUNDS
from kvscope.allocator.layout import (
    DUMP_HEADER_DTYPE,
    HEADER_CHECKSUM_BYTES,
    HEADER_DTYPE,
    SegmentView,
)
from kvscope.allocator.segment import data_path, segment_path
from kvscope.dumpfile import read_dump, write_dump
from tests.journals import journal_save

pytestmark = pytest.mark.slow

# Per input: generous on a busy 2-core machine; a healthy analysis of this pool takes ~0.1 s.
TIME_BOUND_S = 20.0
# Per worker, above what it had mapped when it started (torch included).
MEMORY_BOUND_BYTES = 1536 * 2**20

INTERESTING = [
    0,
    1,
    2,
    7,
    255,
    2**16,
    2**31 - 2,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**63,
    2**64 - 1,
]
GEOMETRY = [name for name, _, _ in BOUNDS] + [
    "header_size",
    "slots_per_block",
    "num_locks",
    "segment_size",
    "data_bytes",
    "off_blocks",
    "off_ring",
    "off_clients",
    "off_events",
    "off_findings",
]
SECTIONS = ["blocks", "ring_header", "ring", "index", "seqs", "locks", "clients", "events",
            "findings", "lockgraph", "sites"]  # fmt: skip


def _put(buf: np.ndarray, value: int) -> None:
    """Store value (wrapped to the field's width) into a one-element array view."""
    width = buf.dtype.itemsize * 8
    raw = (value % 2**width).to_bytes(buf.dtype.itemsize, "little")
    buf.view(np.uint8)[:] = np.frombuffer(raw, np.uint8)


def _reseal_header(seg: bytearray) -> None:
    raw = np.frombuffer(seg, np.uint8)
    s = header_checksum(raw)
    off = HEADER_DTYPE.fields["checksum"][1]
    seg[off : off + 8] = s.to_bytes(8, "little")


def mutate_header(seg: bytearray, rng: random.Random) -> str:
    """Huge or odd geometry, with the header checksum recomputed."""
    field = rng.choice(GEOMETRY)
    value = rng.choice(INTERESTING + [rng.getrandbits(32)])
    h = np.frombuffer(seg, HEADER_DTYPE, 1)
    _put(h[field], value)
    _reseal_header(seg)
    return f"header {field}={value}"


def _leaf_fields(dtype: np.dtype, prefix: str = "") -> list[str]:
    out = []
    for name in dtype.names or ():
        sub = dtype.fields[name][0]
        if sub.names:
            out += _leaf_fields(sub, prefix + name + ".")
        elif sub.base.kind in "ui":
            out.append(prefix + name)
    return out


# Fields that carry ids, counts, positions or enums: where an unchecked value would index,
# loop or allocate. Half the record mutations pick one of these, half any integer field.
SENSITIVE = [
    ("header", "findings_head"), ("header", "num_sites_used"), ("header", "lockgraph_used"),
    ("header", "cuda_ipc_len"), ("ring_header", "head"), ("ring_header", "tail"),
    ("ring_header", "count"), ("ring", None), ("blocks", "state"), ("blocks", "refcount"),
    ("blocks", "owner_client"), ("blocks", "site"), ("blocks", "num_tokens"),
    ("blocks", "indexed"), ("blocks", "generation"), ("index", "block"), ("seqs", "state"),
    ("seqs", "num_blocks"), ("seqs", "table"), ("seqs", "owner_client"), ("seqs", "reserved"),
    ("clients", "state"), ("clients", "local_count"), ("clients", "local"),
    ("clients", "journal_count"), ("clients", "journal_used"), ("clients", "journal.offset"),
    ("clients", "journal.length"), ("clients", "journal.data_off"), ("clients", "event_head"),
    ("clients", "event_count"), ("clients", "pid"), ("events", "block"), ("events", "op"),
    ("events", "time_ns"), ("findings", "severity"), ("findings", "block"),
    ("findings", "time_ns"), ("locks", "holder_pid"), ("locks", "holder_client"),
    ("locks", "acquired_ns"),
]  # fmt: skip


def mutate_record(seg: bytearray, layout, rng: random.Random) -> str:
    """An out-of-range value in one field of one record, blocks resealed."""
    view = SegmentView(seg, layout)
    if rng.random() < 0.5:
        section, field = rng.choice(SENSITIVE)
    else:
        section, field = rng.choice(SECTIONS), ""
    arr = getattr(view, section)
    if section == "events":
        arr = arr.reshape(-1)
    if field is None:
        i = rng.randrange(len(arr))
        _put(arr[i : i + 1], rng.choice(INTERESTING))
        return f"{section}[{i}]"
    if not field:
        fields = _leaf_fields(arr.dtype)
        if not fields:
            return "nothing"
        field = rng.choice(fields)
    path = field.split(".")
    i = rng.randrange(len(arr))
    target = arr[i : i + 1][path[0]]
    for p in path[1:]:
        target = target[p]
    target = target.reshape(-1)
    j = rng.randrange(len(target))
    value = rng.choice(INTERESTING + [rng.getrandbits(64)])
    _put(target[j : j + 1], value)
    if section == "blocks" and rng.random() < 0.8:
        ids = np.arange(len(view.blocks), dtype=np.int64)
        view.blocks["checksum"] = block_checksums(view.blocks, ids)
    return f"{section}[{i}].{field}[{j}]={value}"


def flip_bits(buf: bytearray, rng: random.Random, lo: int, hi: int) -> str:
    k = rng.randint(1, 8)
    for _ in range(k):
        pos = rng.randrange(lo, hi)
        buf[pos] ^= 1 << rng.randrange(8)
    return f"{k} bit flips in [{lo}, {hi})"


@pytest.fixture(scope="module")
def seed_pool(tmp_path_factory):
    """A pool with every section in use, as dump bytes (and a data file to go with it)."""
    import uuid

    name = f"fz-{uuid.uuid4().hex[:8]}"
    cfg = PoolConfig(num_blocks=48, block_size=4, head_dim=8, num_layers=1, dtype="float32",
                     max_clients=4, event_capacity=64, max_seqs=32, events=True)  # fmt: skip
    pool = KVPool.create(name, cfg)
    try:
        shared = list(range(1000, 1012))
        a = pool.allocate("fz-req-a", shared + [1, 2, 3])
        pool.mark_computed(a, 12)
        b = pool.allocate("fz-req-b", shared + [4])
        pool.fork(b, "fz-req-c")
        pool.append(a, [5, 6])
        pool.free(b)
        from kvscope.allocator.findings import Finding

        pool.report(Finding("lock_held_too_long", "seeded finding", block=3, request="fz-req-a"))
        # A dead process: attached, a sequence, and an undo journal it never committed.
        pid = os.fork()
        if pid == 0:
            child = KVPool.attach(name)
            child.allocate("fz-req-dead", [7, 8, 9, 10, 11])
            journal_save(child, child.view.offsets["blocks"], 64)
            os.kill(os.getpid(), signal.SIGKILL)
        os.waitpid(pid, 0)
        out = tmp_path_factory.mktemp("fz") / "seed.kvd"
        write_dump(pool, out, reason="fuzz seed")
        data = open(data_path(name), "rb").read()
    finally:
        pool.close()
        pool.unlink()
    raw = out.read_bytes()
    view, _ = read_dump(out)
    return raw, view.layout, data


def build_inputs(seed_pool, where) -> list[dict]:
    """Every input file and the verb lines to run on it (seeded: the same on every run)."""
    raw, layout, data = seed_pool
    head = DUMP_HEADER_DTYPE.itemsize
    seg0 = bytearray(raw[head:])
    shm = os.environ.get("KVSCOPE_SHM_DIR", "/dev/shm")
    runs: list[dict] = []

    def emit(i: int, what: str, dump: bytes, seg: bytes | None, live: str | None) -> None:
        path = os.path.join(where, f"in{i}.kvd")
        with open(path, "wb") as f:
            f.write(dump)
        runs.append({"what": what, "argv": ["analyze", path]})
        if seg is not None:
            p = os.path.join(where, f"in{i}.seg")
            with open(p, "wb") as f:
                f.write(seg)
            runs.append({"what": what + " (raw segment)", "argv": ["analyze", p, "--json"]})
        if live is not None and seg is not None:
            name = f"fz{os.getpid()}x{i}"
            fd = os.open(os.path.join(shm, "kvscope." + name), os.O_CREAT | os.O_WRONLY, 0o600)
            os.write(fd, seg)
            os.close(fd)
            fd = os.open(os.path.join(shm, f"kvscope.{name}.data"), os.O_CREAT | os.O_WRONLY, 0o600)
            os.write(fd, data)
            os.close(fd)
            runs.append({"what": what + " (live)", "argv": ["check", name, *live.split()],
                         "pool": name})  # fmt: skip

    i = 0
    for seed in range(40):
        rng = random.Random(seed)
        seg = bytearray(seg0)
        what = f"seed {seed}: " + mutate_header(seg, rng)
        emit(i, what, raw[:head] + bytes(seg), bytes(seg), "" if seed % 2 else None)
        i += 1
    for seed in range(60):
        rng = random.Random(1000 + seed)
        seg = bytearray(seg0)
        what = f"seed {1000 + seed}: " + "; ".join(
            mutate_record(seg, layout, rng) for _ in range(3)
        )
        live = "--repair" if seed % 3 == 0 else ("" if seed % 3 == 1 else None)
        emit(i, what, raw[:head] + bytes(seg), bytes(seg), live)
        i += 1
    for seed in range(30):
        rng = random.Random(2000 + seed)
        seg = bytearray(seg0)
        lo, hi = (0, HEADER_CHECKSUM_BYTES) if seed % 2 else (0, len(seg))
        what = f"seed {2000 + seed}: " + flip_bits(seg, rng, lo, hi)
        emit(i, what, raw[:head] + bytes(seg), bytes(seg) if seed % 3 == 0 else None, None)
        i += 1
    for seed in range(30):
        rng = random.Random(3000 + seed)
        dump = bytearray(raw)
        if seed % 3 == 0:
            what = f"seed {3000 + seed}: " + flip_bits(dump, rng, 0, head)
        elif seed % 3 == 1:
            # A corrupt segment header, so the saved copy in the dump header lays it out, and
            # that copy holds an odd geometry.
            dump[head + HEADER_DTYPE.fields["checksum"][1]] ^= 0xFF
            saved = DUMP_HEADER_DTYPE.fields["segment_header_prefix"][1]
            prefix = bytearray(dump[saved : saved + 256] + bytes(HEADER_DTYPE.itemsize - 256))
            what = f"seed {3000 + seed}: saved header " + mutate_header(prefix, rng)
            dump[saved : saved + 256] = prefix[:256]
        else:
            field = rng.choice(["segment_size", "data_size", "flags"])
            value = rng.choice(INTERESTING)
            h = np.frombuffer(dump, DUMP_HEADER_DTYPE, 1)
            _put(h[field], value)
            what = f"seed {3000 + seed}: dump header {field}={value}"
        emit(i, what, bytes(dump), None, None)
        i += 1
    for seed in range(20):
        rng = random.Random(4000 + seed)
        cut = rng.randrange(len(raw))
        emit(
            i,
            f"seed {4000 + seed}: truncated at {cut}",
            raw[:cut],
            seg0[: max(0, cut - head)],
            None,
        )
        i += 1
    return runs


def test_hostile_inputs_exit_0_1_or_2_in_bounded_time_and_memory(seed_pool, tmp_path):
    # GIVEN ~180 seeded hostile inputs and the verb line for each
    runs = build_inputs(seed_pool, str(tmp_path))
    spec = tmp_path / "spec.json"
    out = tmp_path / "results.json"
    spec.write_text(json.dumps({"runs": runs, "out": str(out), "time_bound_s": TIME_BOUND_S,
                                "memory_bound_bytes": MEMORY_BOUND_BYTES}))  # fmt: skip
    try:
        # WHEN one worker runs them all through kvscope.cli.main, each bounded
        worker = subprocess.run(
            [sys.executable, "-m", "tests.fuzz_worker", str(spec)],
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        shm = os.environ.get("KVSCOPE_SHM_DIR", "/dev/shm")
        for r in runs:
            if "pool" in r:
                for p in (os.path.join(shm, "kvscope." + r["pool"]), data_path(r["pool"]),
                          segment_path(r["pool"])):  # fmt: skip
                    if os.path.lexists(p):
                        os.unlink(p)
    assert worker.returncode == 0, worker.stderr[-3000:]
    results = json.loads(out.read_text())
    assert len(results) == len(runs)
    # THEN every run answered 0, 1 or 2, one line for 2, inside the bounds
    bad = []
    for r in results:
        problem = None
        if r["crash"]:
            problem = "raised:\n" + r["crash"]
        elif r["code"] not in (0, 1, 2):
            problem = f"exit {r['code']}"
        elif "Traceback" in r["stderr"]:
            problem = "traceback on stderr"
        elif r["code"] == 2:
            lines = [ln for ln in r["stderr"].splitlines() if ln.strip()]
            if len(lines) != 1 or not lines[0].startswith("kvscope: error: "):
                problem = f"exit 2 with stderr {r['stderr']!r}"
        elif r["elapsed_s"] > TIME_BOUND_S:
            problem = f"took {r['elapsed_s']:.1f} s"
        if problem:
            bad.append(f"{r['what']} {r['argv']}: {problem}")
    assert not bad, "\n\n".join(bad[:10])
    codes = [r["code"] for r in results]
    # The mutations reach past the refusals: findings (1) and usable inputs (0) occur too.
    assert codes.count(2) and codes.count(1) and codes.count(0), codes
