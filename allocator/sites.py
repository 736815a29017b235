"""Allocation sites: the first frame outside kvscope, interned as `file:line function`."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from kvscope.allocator.layout import NUM_SITES

if TYPE_CHECKING:
    from types import FrameType

    from kvscope.allocator.pool import KVPool

_KVSCOPE_DIRS = tuple(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + d + os.sep
    for d in ("allocator", "kernels", "probes", "tui", "kvscope")
)
_SKIP = ("<frozen runpy>", "<frozen importlib", "/runpy.py")


def caller_site() -> str:
    """`file:line function` of the first frame outside kvscope (cheap: no traceback objects)."""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(_KVSCOPE_DIRS) and not name.endswith(_SKIP):
            cwd = os.getcwd() + os.sep
            shown = name[len(cwd) :] if name.startswith(cwd) else name
            return f"{shown}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return "<kvscope>"


class SiteTable:
    """This process's view of the segment's site table: text -> id, interned once per process."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.cache: dict[tuple[str, int, str], int] = {}
        self.lock = pool.locks.index("sites")

    def site(self) -> int:
        """The id of the calling site (interning it on first sight)."""
        f: FrameType | None = sys._getframe(1)
        while f is not None and f.f_code.co_filename.startswith(_KVSCOPE_DIRS):
            f = f.f_back
        if f is None:
            return -1
        key = (f.f_code.co_filename, f.f_lineno, f.f_code.co_name)
        sid = self.cache.get(key)
        if sid is None:
            sid = self.cache[key] = self._intern(caller_site())
        return sid

    def _intern(self, text: str) -> int:
        view = self.pool.view
        raw = text.encode()[:120]

        def op(t) -> int:
            h = view.header
            used = int(h["num_sites_used"][0])
            texts = view.sites["text"][:used]
            found = (texts == raw).nonzero()[0]
            if len(found):
                return int(found[0])
            if used >= NUM_SITES:
                return -1
            t.journal.save(
                view.offsets["sites"] + used * view.sites.dtype.itemsize, view.sites.dtype.itemsize
            )
            t.journal.save(h.dtype.fields["num_sites_used"][1], 4)
            view.sites["text"][used] = raw
            h["num_sites_used"] = used + 1
            return used

        return self.pool._run({self.lock}, op)


def site_text(view, site: int) -> str | None:
    """The text of a site id in a segment view (None when not recorded)."""
    if site < 0 or site >= int(view.h["num_sites_used"]):
        return None
    return bytes(view.sites["text"][site]).decode(errors="replace")
