"""LeakSanitizer-style summary at process exit: blocks still held, by allocation site."""

from __future__ import annotations

import os
import sys
from collections import Counter
from typing import Any

import numpy as np

from kvscope.allocator.layout import BlockState
from kvscope.allocator.sites import site_text


def held_by_me(pool: Any) -> np.ndarray:
    """Blocks this process allocated that are still ALLOCATED and unindexed."""
    b = pool.view.blocks
    return np.flatnonzero(
        (b["owner_pid"] == pool.pid) & (b["state"] == BlockState.ALLOCATED) & (b["indexed"] == 0)
    )


def summary(pool: Any) -> str | None:
    """The exit summary of one pool, or None when this process holds nothing in it."""
    ids = held_by_me(pool)
    if len(ids) == 0:
        return None
    b = pool.view.blocks
    sites: Counter[str] = Counter()
    requests: dict[str, set[str]] = {}
    for blk in ids.tolist():
        where = (
            site_text(pool.view, int(b["site"][blk]))
            or "(allocation site not recorded: KVSCOPE_OWNERSHIP=1)"
        )
        sites[where] += 1
        requests.setdefault(where, set()).add(bytes(b["request"][blk]).decode(errors="replace"))
    tokens = int(b["num_tokens"][ids].sum())
    reqs = {bytes(r).decode(errors="replace") for r in b["request"][ids]}
    lines = [
        f"==kvscope== LEAK SUMMARY: pool {pool.name!r}: {len(ids)} blocks ({tokens} tokens of KV) "
        f"in {len(reqs)} request(s) still held by pid {pool.pid} at exit"
    ]
    for where, n in sites.most_common():
        lines.append(
            f"==kvscope==   {n} block(s) allocated at {where} ({len(requests[where])} request(s))"
        )
    return "\n".join(lines)


def print_summaries(pools: list[Any], file=sys.stderr) -> int:
    """Print the summary of every open pool; return the number of leaked blocks."""
    total = 0
    for pool in pools:
        if getattr(pool, "_closed", True) or pool.pid != os.getpid():
            continue
        text = summary(pool)
        if text:
            total += len(held_by_me(pool))
            print(text, file=file, flush=True)
    return total
