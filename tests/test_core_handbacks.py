"""What the C core once handed to the Python path it now does itself: a call site's text,
composed and interned by the core (no call of the handle's `site_of`)."""

from __future__ import annotations

import sys

from kvscope.allocator import KVPool, sites
from kvscope.allocator.sites import site_frames


def _refuse(monkeypatch, owner: object, name: str) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} ran")

    monkeypatch.setattr(owner, name, refuse)


def _alloc(pool: KVPool, name: str):
    return pool.allocate(name, [7] * 5), sys._getframe()


def _outer(pool: KVPool, name: str):
    return _alloc(pool, name), sys._getframe()


def _site_of_block(pool: KVPool, seq) -> int:
    return int(pool.view.blocks["site"][seq.block_table[0]])


def test_the_core_composes_a_site_as_sites_py_does(make_pool, monkeypatch):
    # GIVEN the ownership probe (one frame a site) on the core, sites.py's recorder refused
    monkeypatch.setenv("KVSCOPE_OWNERSHIP", "1")
    monkeypatch.delenv("KVSCOPE_STACK_DEPTH", raising=False)
    pool = make_pool(16)
    _refuse(monkeypatch, sites.SiteTable, "site")
    _refuse(monkeypatch, sites.SiteTable, "_intern")
    handed = pool._native.stats()["fallbacks"]
    # WHEN a sequence is allocated twice from one line
    (a, frame), (b, _) = _alloc(pool, "a"), _alloc(pool, "b")
    # THEN the core ran both, and the site is the frame's text as sites.py composes it, once
    assert pool._native.stats()["fallbacks"] == handed
    assert site_frames(pool.view, _site_of_block(pool, a)) == [sites.frame_text(frame)]
    assert _site_of_block(pool, b) == _site_of_block(pool, a)
    assert int(pool.view.h["num_sites_used"]) == 1


def test_the_core_composes_a_stack_as_sites_py_does(make_pool, monkeypatch):
    # GIVEN stacks of 2 frames, sites.py's recorder refused
    monkeypatch.setenv("KVSCOPE_OWNERSHIP", "1")
    monkeypatch.setenv("KVSCOPE_STACK_DEPTH", "2")
    pool = make_pool(16)
    _refuse(monkeypatch, sites.SiteTable, "site")
    _refuse(monkeypatch, sites.SiteTable, "_intern")
    handed = pool._native.stats()["fallbacks"]
    # WHEN one stack allocates twice
    ((a, inner), outer), ((b, _), _) = _outer(pool, "a"), _outer(pool, "b")
    # THEN the core ran both: 2 frame entries and 1 stack entry, as sites.py interns them
    assert pool._native.stats()["fallbacks"] == handed
    frames = site_frames(pool.view, _site_of_block(pool, a))
    assert frames == [sites.frame_text(inner), sites.frame_text(outer)]
    assert _site_of_block(pool, b) == _site_of_block(pool, a)
    assert int(pool.view.h["num_sites_used"]) == 3
    raw = bytes(pool.view.sites["text"][_site_of_block(pool, a)]).rstrip(b"\0")
    assert raw == b"stack: 0 1"
