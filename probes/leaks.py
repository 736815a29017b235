"""LeakSanitizer-style summary of the requests a process still holds when it exits or closes a pool.

The summary counts exactly what the exit check reports as `leak_finished` (kvscope/child.py): the
sequences of this process that still hold blocks, grouped by the call that created them, with
the distinct blocks they hold. So the summary and the findings name the same requests and blocks.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def creation_site(view: Any, slot: int, *, function: bool = False) -> str | None:
    """The frame that created the sequence in `slot` (allocate or fork), when sites are
    recorded: `file:line`, or `file:line function` with `function`."""
    from kvscope.allocator.sites import site_frames

    recorded = int(view.seqs["site"][slot])
    frames = site_frames(view, recorded - 1) if recorded else []
    if not frames:
        return None
    return frames[0] if function else frames[0].rsplit(" ", 1)[0]


def summary(pool: Any, seqs: list[Any], when: str) -> str | None:
    """The summary of one pool's leaked sequences `seqs` (None when there is none); `when`
    says at what moment they were found (`at exit`, `when the pool was closed`)."""
    if not seqs:
        return None
    b = pool.view.blocks

    def blocks_of(group: list[Any]) -> np.ndarray:
        return np.unique(np.concatenate([np.asarray(s.block_table, np.int64) for s in group]))

    ids = blocks_of(seqs)
    tokens = int(b["num_tokens"][ids].sum())
    by_site: dict[str, list[Any]] = {}
    for s in seqs:
        where = (
            creation_site(pool.view, s.slot, function=True)
            or "(creation site not recorded: KVSCOPE_OWNERSHIP=1)"
        )
        by_site.setdefault(where, []).append(s)
    waiting = sum(1 for s in seqs if not s.block_table)
    lines = [
        f"==kvscope== LEAK SUMMARY: pool {pool.name!r}: {len(ids)} blocks ({tokens} tokens of KV)"
        f" in {len(seqs)} request(s) still held by pid {pool.pid} {when}"
        + (f" ({waiting} of them preempted, holding no block)" if waiting else "")
    ]
    for where, group in sorted(by_site.items(), key=lambda kv: -len(kv[1])):
        lines.append(
            f"==kvscope==   {len(blocks_of(group))} block(s) held by {len(group)} request(s)"
            f" created at {where}"
        )
    return "\n".join(lines)
