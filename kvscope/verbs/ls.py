"""List the pools on this host: name, device, geometry, occupancy, owners alive/dead, probes on.

Occupancy accounts for every block of one snapshot: held (allocated to requests, with their
share of the pool), cached, local (in a process's local cache), quarantined and free add up to
the pool's blocks; the snapshot's time is printed under the table (`read_ns` in --json).

Each pool is read under the seqlock without attaching to it. A pool that cannot be read (a
corrupt header, another user's file: `--trust-owner` reads those) is listed with the reason;
anything in the directory that is not a regular file (a directory, a FIFO, a symlink) is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np

from kvscope.allocator.errors import PoolError
from kvscope.allocator.layout import ClientState
from kvscope.allocator.process import is_alive, is_stopped
from kvscope.allocator.segment import list_names, segment_path
from kvscope.allocator.stats import pool_stats
from kvscope.poolsummary import pool_info
from kvscope.report import JSON_SCHEMA, console
from kvscope.target import add_trust_owner, read_live
from kvscope.tui.frame import clock

# The text columns; held, cached, local, quarantined and free add up to the pool's blocks.
COLUMNS = (
    "pool",
    "device",
    "geometry",
    "held",
    "cached",
    "local",
    "quarantined",
    "free",
    "owners",
    "probes",
)


def describe(name: str, trust_owner: bool = False) -> dict[str, Any] | None:
    """One row of `kvscope ls` for the pool `name`."""
    try:
        view = read_live(name, trust_owner)
    except PoolError as e:
        if not os.path.isfile(segment_path(name)) or os.path.islink(segment_path(name)):
            return None  # removed since it was listed, or replaced by something not a pool
        return {"name": name, "error": str(e)}
    read_ns = time.time_ns()
    info = pool_info(view)
    st = pool_stats(view)
    c = view.clients
    attached = np.flatnonzero(c["state"] == ClientState.ATTACHED).tolist()
    alive = [int(c["pid"][i]) for i in attached if is_alive(int(c["pid"][i]), int(c["start"][i]))]
    dead = [int(c["pid"][i]) for i in attached if int(c["pid"][i]) not in alive]
    # (SIGSTOP or a debugger: alive, serving nothing until continued)
    stopped = [p for p in alive if is_stopped(p)]
    return {
        "name": name,
        "device": info["device"],
        "geometry": info["geometry"],
        # every block in one of these, from one snapshot: they add up to num_blocks
        "num_blocks": st["num_blocks"],
        "num_free": st["num_free"],
        "num_cached": st["num_cached"],
        # the blocks requests hold (allocated; utilization is their share of the pool)
        "num_held": st["num_allocated"],
        "num_allocated": st["num_allocated"],
        "num_local": st["num_local"],
        "num_quarantined": st["num_quarantined"],
        "utilization": st["utilization"],
        # when that snapshot was read (wall clock, ns since the epoch)
        "read_ns": read_ns,
        "owners_alive": alive,
        "owners_dead": dead,
        "owners_stopped": stopped,
        "probes": [k for k, v in info["flags"].items() if v],
    }


class LsCommand:
    """List the pools on this host with their geometry, occupancy, owners and probes."""

    @staticmethod
    def prepare_parser(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help="print one JSON list")
        add_trust_owner(parser)

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        rows = [r for r in (describe(n, args.trust_owner) for n in list_names()) if r is not None]
        if args.json:
            # A list, as always; each row carries the schema version (docs/CLI.md).
            print(json.dumps([{"schema": JSON_SCHEMA, **r} for r in rows], indent=2))
            return 0
        from rich.table import Table

        con = console()
        if not rows:
            con.print("no pools on this host")
            return 0
        t = Table(box=None, pad_edge=False, show_edge=False)
        name_width = max(len(r["name"]) for r in rows)
        for col in COLUMNS:
            t.add_column(
                col, no_wrap=col != "owners", min_width=name_width if col == "pool" else None
            )
        unreadable = []
        for r in rows:
            if "error" in r:
                # A long message would squeeze every column: it gets its own line below.
                t.add_row(r["name"], "-", "unreadable (below)", *[""] * (len(COLUMNS) - 3))
                unreadable.append(f"{r['name']}: {r['error']}")
                continue
            g = r["geometry"]
            owners = f"{len(r['owners_alive'])} alive"
            if r["owners_stopped"]:
                owners += f" ({len(r['owners_stopped'])} stopped)"
            if r["owners_dead"]:
                owners += (
                    f", {len(r['owners_dead'])} dead ({', '.join(map(str, r['owners_dead']))})"
                )
            t.add_row(
                r["name"],
                r["device"],
                f"{g['num_blocks']}x{g['block_size']} {g['num_layers']}L {g['num_kv_heads']}x{g['head_dim']} {g['dtype']}",
                f"{r['num_held']} ({r['utilization']:.0%})",
                str(r["num_cached"]),
                str(r["num_local"]),
                str(r["num_quarantined"]),
                str(r["num_free"]),
                owners,
                ",".join(r["probes"]) or "-",
            )
        con.print(t)
        for line in unreadable:
            con.print(line)
        read = [r["read_ns"] for r in rows if "read_ns" in r]
        if read:
            # to line this listing up with what another reader printed
            first, last = clock(min(read)), clock(max(read))
            con.print(f"read at {first}" if first == last else f"read from {first} to {last}")
        return 0
