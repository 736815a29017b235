"""NVML beside the pool on a real GPU, checked against nvidia-smi in the same moment.

    python bench/bench_nvml.py --gib 32 --json nvml.json      # on a CUDA machine

Creates a pool of about `--gib` GiB of KV data on each GPU asked for (`--devices cuda:0,...`),
then, for each, reads the GPU's memory three ways one after the other: `gpu_memory` (what
`kvscope analyze` shows), the `GpuMetrics` gauges (what the OpenTelemetry exporter sends; read
directly, so OpenTelemetry need not be installed), and `nvidia-smi`. Then runs
`kvscope analyze NAME` on each live pool and prints its output.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

MIB = 2**20


def smi() -> dict[int, dict[str, int]]:
    """nvidia-smi's used and total MiB per GPU index."""
    out = subprocess.run(
        [
            "nvidia-smi",
            "--query-gpu=index,memory.used,memory.total",
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = {}
    for line in out.strip().splitlines():
        index, used, total = (int(x) for x in line.split(","))
        rows[index] = {"used_mib": used, "total_mib": total}
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=32.0, help="KV data per pool")
    ap.add_argument("--devices", default="cuda:0")
    ap.add_argument("--json", help="write the readings here")
    args = ap.parse_args(argv)

    from kvscope.allocator import KVPool, PoolConfig
    from kvscope.probes.nvml import GpuMetrics, gpu_memory, nvml_index

    # Llama-2-7B's KV geometry: 8 MiB a 16-token block in fp16
    block_bytes = 2 * 32 * 16 * 32 * 128 * 2
    pools = []
    readings: list[dict[str, Any]] = []
    try:
        for device in args.devices.split(","):
            name = f"nvml-{os.getpid()}-{device.replace(':', '')}"
            config = PoolConfig(
                num_blocks=int(args.gib * 2**30 // block_bytes),
                block_size=16,
                num_layers=32,
                num_kv_heads=32,
                head_dim=128,
                dtype="float16",
                device=device,
            )
            pools.append(KVPool.create(name, config))
        gpus = GpuMetrics()
        for pool in pools:
            device = pool.config.device
            index = nvml_index(device)
            mem = gpu_memory(device)
            handle = gpus.devices[index].handle
            gauges = {"usage": gpus._usage(handle), "limit": gpus._limit(handle)}
            # NVML's version-1 reading, which counts the driver's reserved memory as used
            v1_used = int(gpus.nvml.nvmlDeviceGetMemoryInfo(handle).used)
            table = smi()[index]
            assert mem is not None
            row = {
                "pool": pool.name,
                "device": device,
                "pool_kv_bytes": int(pool.kv.numel() * pool.kv.element_size()),
                "gpu_memory": mem,
                "gauges": gauges,
                "nvidia_smi": table,
                "used_mib": {
                    "gpu_memory": round(mem["used"] / MIB),
                    "gauge": round(gauges["usage"] / MIB),
                    "nvidia_smi": table["used_mib"],
                    "nvml_v1": round(v1_used / MIB),
                },
                "total_mib": {
                    "gpu_memory": round(mem["total"] / MIB),
                    "gauge": round(gauges["limit"] / MIB),
                    "nvidia_smi": table["total_mib"],
                },
            }
            readings.append(row)
            print(json.dumps({k: row[k] for k in ("pool", "device", "used_mib", "total_mib")}))
            print(f"pool KV data: {row['pool_kv_bytes'] / MIB:.0f} MiB", flush=True)
        gpus.close()
        for pool in pools:
            analyzed = subprocess.run(
                [sys.executable, "-m", "kvscope", "analyze", pool.name],
                capture_output=True,
                text=True,
            )
            print(f"$ kvscope analyze {pool.name}\n{analyzed.stdout}{analyzed.stderr}", flush=True)
            readings.append({"analyze": pool.name, "output": analyzed.stdout})
    finally:
        for pool in pools:
            pool.close()
            pool.unlink()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(readings, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
