"""Allocation sites: the first frame outside kvscope, interned as `file:line function`.

With KVSCOPE_STACK_DEPTH=N (N > 1) a site is the stack of up to N frames outside kvscope, from
the allocation outward: each frame is interned as its own entry (as at depth 1), and the stack
as one more entry whose text is `stack: ID ID ...` (the frames' ids), interned once per distinct
stack. A block's `site` names the stack entry; `site_frames` reads it back.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from kvscope.allocator.layout import SITE_DTYPE

if TYPE_CHECKING:
    from types import FrameType

    from kvscope.allocator.handle import PoolHandle

KVSCOPE_DIRS = _KVSCOPE_DIRS = tuple(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + d + os.sep
    for d in ("allocator", "kernels", "probes", "tui", "kvscope")
)
_SKIP = ("<frozen runpy>", "<frozen importlib", "/runpy.py")
STACK_PREFIX = b"stack: "
# Frame ids of up to 4 digits: a stack entry of 16 frames fits the site text (120 bytes).
MAX_STACK_DEPTH = 16
SITE_TEXT_BYTES = SITE_DTYPE["text"].itemsize


def stack_depth(environ: dict[str, str] | None = None) -> int:
    """Frames recorded per allocation site: KVSCOPE_STACK_DEPTH (1 when unset or not a number)."""
    raw = (os.environ if environ is None else environ).get("KVSCOPE_STACK_DEPTH", "")
    try:
        return min(max(1, int(raw)), MAX_STACK_DEPTH)
    except ValueError:
        return 1


def _outside(f: FrameType) -> bool:
    name = f.f_code.co_filename
    return not name.startswith(_KVSCOPE_DIRS) and not name.endswith(_SKIP)


def frame_text(f: FrameType) -> str:
    """`file:line function`, the file relative to the working directory when under it."""
    name = f.f_code.co_filename
    cwd = os.getcwd() + os.sep
    shown = name[len(cwd) :] if name.startswith(cwd) else name
    return f"{shown}:{f.f_lineno} {f.f_code.co_name}"


def caller_site() -> str:
    """`file:line function` of the first frame outside kvscope (cheap: no traceback objects)."""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        if _outside(f):
            return frame_text(f)
        f = f.f_back
    return "<kvscope>"


class SiteTable:
    """This process's view of the segment's site table: text -> id, interned once per process."""

    def __init__(self, pool: PoolHandle, depth: int | None = None):
        self.pool = pool
        self.cache: dict[tuple[str, int, str], int] = {}
        self.stacks: dict[tuple[int, ...], int] = {}
        self.outside: dict[int, bool] = {}
        self.codes: list[object] = []
        self.depth = stack_depth() if depth is None else depth

    def site(self) -> int:
        """The id of the calling site (interning it on first sight)."""
        f: FrameType | None = sys._getframe(1)
        while f is not None and f.f_code.co_filename.startswith(_KVSCOPE_DIRS):
            f = f.f_back
        if f is None:
            return -1
        if self.depth > 1:
            return self._stack(f)
        key = (f.f_code.co_filename, f.f_lineno, f.f_code.co_name)
        sid = self.cache.get(key)
        if sid is None:
            sid = self.cache[key] = self._intern(caller_site())
        return sid

    def _stack(self, f: FrameType) -> int:
        """The id of the stack from `f` outward: up to `depth` frames, up to the first frame of
        kvscope or of runpy (the bootstrap that started the script)."""
        outside = self.outside
        key: list[int] = []
        frames: list[FrameType] = []
        g: FrameType | None = f
        while g is not None and len(frames) < self.depth:
            code = g.f_code
            # Whether a code object is outside kvscope, by its id: a dict lookup per frame
            # instead of two string tests (the code objects are kept alive: ids stay theirs).
            out = outside.get(id(code))
            if out is None:
                out = outside[id(code)] = _outside(g)
                self.codes.append(code)
            if out:
                frames.append(g)
                key += (id(code), g.f_lineno)
            elif frames:
                break
            g = g.f_back
        if not frames:
            return -1
        sid = self.stacks.get(tuple(key))
        if sid is None:
            sid = self.stacks[tuple(key)] = self._intern_stack(frames)
        return sid

    def _intern_stack(self, frames: list[FrameType]) -> int:
        ids = []
        for fr in frames:
            key = (fr.f_code.co_filename, fr.f_lineno, fr.f_code.co_name)
            fid = self.cache.get(key)
            if fid is None:
                fid = self.cache[key] = self._intern(frame_text(fr))
            ids.append(fid)
        if len(ids) == 1 or min(ids) < 0:
            # One frame, or a full table: the allocation frame alone.
            return ids[0]
        stack = self._intern((STACK_PREFIX + " ".join(map(str, ids)).encode()).decode())
        return stack if stack >= 0 else ids[0]

    def _intern(self, text: str) -> int:
        """The site table's id of `text`, added when new (-1: the table is full): the C core
        writes it, under the sites lock (waited for there, a dead holder of it recovered)."""
        return self.pool.core.intern_site(text.encode()[:SITE_TEXT_BYTES])


def _raw(view, site: int) -> bytes | None:
    used = min(int(view.h["num_sites_used"]), len(view.sites))
    if site < 0 or site >= used:
        return None
    return bytes(view.sites["text"][site])


def site_frames(view, site: int) -> list[str]:
    """The frames of a site id, allocation frame first (one frame at depth 1; [] when none)."""
    raw = _raw(view, site)
    if raw is None:
        return []
    if not raw.startswith(STACK_PREFIX):
        return [raw.decode(errors="replace")]
    out = []
    for tok in raw[len(STACK_PREFIX) :].split():
        frame = _raw(view, int(tok)) if tok.isdigit() else None
        # A stack names frames only; anything else is shown as its id, never followed.
        if frame is None or frame.startswith(STACK_PREFIX):
            out.append(f"site {tok.decode(errors='replace')}")
        else:
            out.append(frame.decode(errors="replace"))
    return out


def site_text(view, site: int) -> str | None:
    """The text of a site id in a segment view, a stack as `frame <- caller <- ...` (None when
    not recorded)."""
    frames = site_frames(view, site)
    return " <- ".join(frames) if frames else None
