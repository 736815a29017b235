"""Shared by the rank tests: `kvscope run` over serve.py --ranks 2 with a leak on rank 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from kvscope.allocator.segment import data_path, segment_path

SERVE = Path(__file__).resolve().parents[1] / "examples" / "serve.py"


def kvscope(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvscope", *args], capture_output=True, text=True, cwd=cwd
    )


def sections(output: str) -> dict[str, str]:
    """`kvscope run`'s output cut into one section per pool it analyzed, by pool name."""
    out: dict[str, str] = {}
    for part in output.split("kvscope run: ")[1:]:
        name = part.split("pool '", 1)[1].split("'", 1)[0]
        out[name] = part
    return out


def leak_on_rank_one(device: str, tmp: Path) -> dict[str, Any]:
    """Serve on 2 ranks under `kvscope run --inject leak` (fault on rank 1), pools kept;
    returns the run's output by pool, `kvscope ls --json` and `analyze --json` of each."""
    base = f"ranks-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    names = [f"{base}-rank0", f"{base}-rank1"]
    run = kvscope(
        "run", "--inject", "leak", str(SERVE), "--device", device, "--ranks", "2",
        "--fault-rank", "1", "--requests", "16", "--output-len", "4:12", "--rate", "0",
        "--no-progress", "--pool-name", base, "--keep-pool",
        cwd=tmp,
    )  # fmt: skip
    try:
        listed = json.loads(kvscope("ls", "--json", cwd=tmp).stdout)
        analyzed = {n: json.loads(kvscope("analyze", n, "--json", cwd=tmp).stdout) for n in names}
    finally:
        for n in names:
            for path in (segment_path(n), data_path(n)):
                if os.path.exists(path):
                    os.remove(path)
    return {
        "run": run,
        "sections": sections(run.stdout + run.stderr),
        "ls": {r["name"]: r for r in listed if r["name"] in names},
        "analyze": analyzed,
        "names": names,
    }
