"""Allocation sites: the first frame outside kvscope, interned as `file:line function`.

With KVSCOPE_STACK_DEPTH=N (N > 1) a site is the stack of up to N frames outside kvscope, from
the allocation outward: each frame is interned as its own entry (as at depth 1), and the stack
as one more entry whose text is `stack: ID ID ...` (the frames' ids), interned once per distinct
stack. The C core composes and interns them (csrc/probes.c, frames outside KVSCOPE_DIRS, as
`frame_text` writes one); a block's `site` names the stack entry; `site_frames` reads it back.
"""

from __future__ import annotations

import os
import re
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import FrameType

KVSCOPE_DIRS = _KVSCOPE_DIRS = tuple(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + d + os.sep
    for d in ("allocator", "kernels", "probes", "tui", "kvscope")
)
_SKIP = ("<frozen runpy>", "<frozen importlib", "/runpy.py")
STACK_PREFIX = b"stack: "
# Frame ids of up to 4 digits: a stack entry of 16 frames fits the site text (120 bytes).
MAX_STACK_DEPTH = 16


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


# The most characters of a store's line with its callers (csrc/stores.c STORE_SITE_CHARS).
STORE_SITE_CHARS = 100


def caller_stack(depth: int) -> str:
    """`file:line function` of the first frame outside kvscope (cheap: no traceback objects),
    and with depth > 1 its callers outside kvscope up to `depth` frames,
    `frame <- caller <- ...` while they fit in STORE_SITE_CHARS (the first frame whatever its
    length): the line a store check names (csrc/stores.c store_site)."""
    f: FrameType | None = sys._getframe(1)
    while f is not None and not _outside(f):
        f = f.f_back
    frames: list[str] = []
    size = -4
    while f is not None and len(frames) < depth and _outside(f):
        text = frame_text(f)
        size += 4 + len(text)
        if frames and size > STORE_SITE_CHARS:
            break  # (the findings ring keeps 200 bytes of a message: room for the rest)
        frames.append(text)
        f = f.f_back
    return " <- ".join(frames) or "<kvscope>"


def _raw(view, site: int) -> bytes | None:
    """A site's text up to its first NUL (the writer pads with them: bytes after one are a
    damaged segment's, as are control bytes, which read as U+FFFD)."""
    used = min(int(view.h["num_sites_used"]), len(view.sites))
    if site < 0 or site >= used:
        return None
    raw = bytes(view.sites["text"][site]).split(b"\0", 1)[0]
    return raw.translate(_CONTROL) if _CONTROL_BYTE.search(raw) else raw


# control bytes to 0xFF, which no UTF-8 text holds: decoded with errors="replace", U+FFFD
_CONTROL = bytes(0xFF if b < 0x20 or b == 0x7F else b for b in range(256))
_CONTROL_BYTE = re.compile(rb"[\x00-\x1f\x7f]")


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
