"""Allocation sites: stacks (KVSCOPE_STACK_DEPTH), interned once per distinct stack; the site a
sequence was created at; the allocation a finding saw, after its block is handed out again."""

from __future__ import annotations

import contextlib
import inspect
import json

from kvscope.allocator import PoolExhausted
from kvscope.allocator.sites import site_frames, site_text, stack_depth
from kvscope.analysis import analyze_view
from kvscope.child import report_held
from kvscope.cli import main


def _helper(pool, name):
    return pool.allocate(name, list(range(5)))


def _from_a(pool, name):
    return _helper(pool, name)


def _from_b(pool, name):
    return _helper(pool, name)


def _site(pool, seq) -> int:
    return int(pool.view.blocks["site"][seq.block_table[0]])


def test_a_helper_called_from_two_places_gives_two_stacks(make_pool, monkeypatch):
    # GIVEN ownership on with 3 frames per site
    monkeypatch.setenv("KVSCOPE_OWNERSHIP", "1")
    monkeypatch.setenv("KVSCOPE_STACK_DEPTH", "3")
    pool = make_pool(32)
    # WHEN one helper allocates for two callers
    a, again = [_from_a(pool, f"ra{i}") for i in range(2)]
    b = _from_b(pool, "rb")
    fa, fb = site_frames(pool.view, _site(pool, a)), site_frames(pool.view, _site(pool, b))
    # THEN both stacks start at the helper and tell the callers apart
    assert len(fa) == len(fb) == 3
    assert "_helper" in fa[0] and "_helper" in fb[0]
    assert "_from_a" in fa[1] and "_from_b" in fb[1]
    assert site_text(pool.view, _site(pool, a)) == " <- ".join(fa)
    # AND a stack seen again is the same entry: the table holds 3 frames and 1 stack entry
    # per distinct stack, the helper's frame once
    assert _site(pool, again) == _site(pool, a)
    assert int(pool.view.h["num_sites_used"]) == (3 + 1) + (2 + 1)


def test_without_depth_a_site_is_one_frame(make_pool, monkeypatch):
    monkeypatch.setenv("KVSCOPE_OWNERSHIP", "1")
    monkeypatch.delenv("KVSCOPE_STACK_DEPTH", raising=False)
    pool = make_pool(32)
    a, b = _from_a(pool, "ra"), _from_b(pool, "rb")
    assert _site(pool, a) == _site(pool, b)
    assert len(site_frames(pool.view, _site(pool, a))) == 1


def test_stack_depth_is_bounded_and_forgiving():
    assert stack_depth({}) == 1
    assert stack_depth({"KVSCOPE_STACK_DEPTH": "8"}) == 8
    assert stack_depth({"KVSCOPE_STACK_DEPTH": "500"}) == 16
    assert stack_depth({"KVSCOPE_STACK_DEPTH": "x"}) == 1
    assert stack_depth({"KVSCOPE_STACK_DEPTH": "0"}) == 1


def test_analyze_shows_the_stack_of_a_finding(make_pool, monkeypatch, tmp_path, capsys):
    # GIVEN a leaked block allocated through the helper, with stacks recorded
    monkeypatch.setenv("KVSCOPE_OWNERSHIP", "1")
    monkeypatch.setenv("KVSCOPE_STACK_DEPTH", "2")
    pool = make_pool(32)
    seq = _from_b(pool, "leaky")
    from kvscope.allocator.findings import Finding

    pool.report(Finding("leak_finished", "leaked", block=seq.block_table[0], request="leaky"))
    dump = tmp_path / "s.kvd"
    assert main(["dump", pool.name, "-o", str(dump)]) == 0
    capsys.readouterr()
    # WHEN analyzed THEN the JSON has the stack and the text names the caller
    main(["analyze", str(dump), "--json"])
    (f,) = [
        f for f in json.loads(capsys.readouterr().out)["findings"] if f["kind"] == "leak_finished"
    ]
    assert len(f["stack"]) == 2 and "_from_b" in f["stack"][1]
    main(["analyze", str(dump)])
    out = capsys.readouterr().out
    assert "allocated at" in out and "called from" in out and "_from_b" in out


def test_a_leaked_sample_is_named_after_the_fork_that_created_it(make_pool, monkeypatch):
    # GIVEN ownership on (sites recorded)
    monkeypatch.setenv("KVSCOPE_OWNERSHIP", "1")
    monkeypatch.delenv("KVSCOPE_STACK_DEPTH", raising=False)
    pool = make_pool(32, max_seqs=256)
    # WHEN a request forks a sample that is never freed (it holds only its parent's blocks)
    parent = _helper(pool, "parent")
    fork_line = inspect.currentframe().f_lineno + 1
    sample = pool.fork(parent, "sample")
    pool.free(parent)
    # THEN the leak is named after the fork's line, where the leaked sequence was created,
    # though the block it is shown by was allocated by the parent's allocate
    assert int(pool.view.seqs["site"][sample.slot]) > 0
    report_held(pool, "the pool was closed")
    (leak,) = [f for f in pool.findings() if f.kind == "leak_finished"]
    assert f"test_sites_stack.py:{fork_line})" in leak.message
    assert leak.request == "sample"
    pool.free(sample)


def test_a_write_after_free_names_the_allocation_of_the_request_that_freed_it(
    make_pool, monkeypatch
):
    # GIVEN guard mode and ownership on a small pool
    monkeypatch.setenv("KVSCOPE_OWNERSHIP", "1")
    monkeypatch.setenv("KVSCOPE_GUARD", "1")
    monkeypatch.delenv("KVSCOPE_STACK_DEPTH", raising=False)
    pool = make_pool(16, max_seqs=256)
    # WHEN a request's block is written after its free, and the block is then handed out again
    # to other requests, allocated on another line
    first_line = inspect.currentframe().f_lineno + 1
    victim = pool.allocate("victim", list(range(4)))
    blk = victim.block_table[0]
    pool.free(victim)
    pool.kv[0, 0, blk, 1] = 7.0
    later = []
    with contextlib.suppress(PoolExhausted):  # every block, in the ring's order
        for i in range(17):
            later.append(pool.allocate(f"next{i}", [i] * 4))
    assert any(blk in s.block_table for s in later)
    # THEN the analysis names the victim's allocation, though the block's record now holds
    # the new owner's
    rep = analyze_view(pool.view)
    (uaf,) = [f for f in rep["findings"] if f["kind"] == "use_after_free"]
    assert uaf["block"] == blk and uaf["request"] == "victim"
    assert f"test_sites_stack.py:{first_line} " in uaf["site"]
    assert "alloc_ns" not in uaf


def test_a_damaged_site_text_reads_up_to_its_first_nul_without_control_bytes(
    make_pool, monkeypatch
):
    # GIVEN a recorded site whose padding a bit flip made non-zero, and one with a control byte
    monkeypatch.setenv("KVSCOPE_OWNERSHIP", "1")
    pool = make_pool(8)
    pool.free(pool.allocate("a", [1, 2, 3]))
    pool.free(pool.allocate("b", [4, 5, 6]))
    text = pool.view.sites["text"]
    first = bytes(text[0]).rstrip(b"\0")
    assert first and len(first) + 4 < text.dtype.itemsize
    text[0] = first + b"\0\0\0\xef"
    text[1] = b"engine.py:9 st\x1bep"
    # WHEN it is read
    # THEN the first reads as written, the second with U+FFFD for the control byte
    assert site_text(pool.view, 0) == first.decode()
    assert site_text(pool.view, 1) == "engine.py:9 st\ufffdep"
