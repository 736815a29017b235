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
    groups = sorted(by_site.items(), key=lambda kv: -len(kv[1]))
    each = [blocks_of(group) for _, group in groups]
    for (where, group), held in zip(groups, each):
        lines.append(
            f"==kvscope==   {len(held)} block(s) held by {len(group)} request(s) created at {where}"
        )
    # A block several requests map (a shared prompt prefix) is one of the distinct blocks of
    # the first line, and counted again in each group and each request's leak_finished line
    # that maps it: said, so that the numbers add up.
    mapped = sum(len(s.block_table) for s in seqs)
    if mapped > len(ids):
        shared = int((np.bincount(np.concatenate(each)) > 1).sum()) if len(each) > 1 else 0
        groups_too = f"{shared} of them in more than one group above; " if shared else ""
        lines.append(
            f"==kvscope==   (blocks the requests share are counted once in the {len(ids)}, and"
            f" in each group and request that maps them: {groups_too}the requests' own"
            f" leak_finished lines add up to {mapped})"
        )
    return "\n".join(lines)
