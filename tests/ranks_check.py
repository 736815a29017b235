"""Shared by the rank tests: `kvscope run` over serve.py --ranks 2 with a leak on rank 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
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
        "run", "--keep-pool", "--inject", "leak", str(SERVE), "--device", device, "--ranks", "2",
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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_two_ranks(device: str, tmp: Path) -> dict[str, Any]:
    """`kvscope run` with the Prometheus exporter over serve.py --ranks 2 on `device`, scraped
    until both ranks' pools have allocated; returns the last scrape's pools (labels and
    allocation count by pool name), its metric families, and the run's exit and stderr."""
    from prometheus_client.parser import text_string_to_metric_families

    port = free_port()
    name = f"ranks-{uuid.uuid4().hex[:8]}"
    cmd = [
        sys.executable, "-m", "kvscope", "run", "--metrics-exporter", "prometheus", "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(port), str(SERVE), "--ranks", "2", "--device", device,
        "--requests", "200", "--rate", "20", "--no-progress", "--pool-name", name,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wanted = [f"{name}-rank0", f"{name}-rank1"]
    pools: dict[str, dict[str, Any]] = {}
    families: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                url = f"http://127.0.0.1:{port}/metrics"
                text = urllib.request.urlopen(url, timeout=5).read().decode()
            except OSError:
                time.sleep(0.2)
                continue
            families = {f.name: f for f in text_string_to_metric_families(text)}
            allocs = families.get("kvscope_pool_allocations")
            pools = {
                s.labels["kvscope_pool_name"]: {"value": s.value, **s.labels}
                for s in (allocs.samples if allocs else [])
                if s.name == "kvscope_pool_allocations_total"
            }
            if set(wanted) <= {p for p, s in pools.items() if s["value"] > 0}:
                break
            time.sleep(0.2)
        _out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return {
        "returncode": proc.returncode,
        "stderr": err if proc.returncode is not None else "",
        "pools": pools,
        "families": families,
        "wanted": wanted,
    }
