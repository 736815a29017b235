"""GPU memory and utilization from NVML, exported beside the pool's own bytes.

    gpus = GpuMetrics()          # no GPU or no driver: one info line, no GPU metrics
    gpus.register(meter)
    ...
    gpus.close()

    gpu_memory("cuda:1")         # {"index", "name", "used", "total", "free"} or None
    reader = GpuMemoryReader("cuda:1"); reader.read()   # the same, NVML kept open (`top`)

Names follow the OpenTelemetry hardware conventions (`hw.gpu.*`, attributes `hw.id`, `hw.name`,
`hw.vendor`), plus `kvscope.gpu.memory.free` (NVML's free bytes: total - used - reserved).
OpenTelemetry is imported only by `register`: `gpu_memory` (what `kvscope analyze` shows beside
a live pool on a GPU) and `GpuMemoryReader` (the same in `kvscope top`'s header) work without it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, Meter, Observation

INDEX = "kvscope.gpu.index"


@dataclass(frozen=True)
class Gpu:
    """One NVML device: its handle and the attributes its data points carry."""

    handle: Any
    attributes: dict[str, Any]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class GpuMetrics:
    """Reads every NVML device; `devices` is empty when there is no GPU or no driver."""

    def __init__(self, nvml: Any = None, note: Callable[[str], None] = _stderr):
        self.nvml = nvml
        self.devices: list[Gpu] = []
        try:
            if self.nvml is None:
                import pynvml

                self.nvml = pynvml
            self.nvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 - ImportError or any NVMLError: no GPU metrics
            note(f"kvscope: no GPU metrics (NVML unavailable: {e or type(e).__name__})")
            self.nvml = None
            return
        for i in range(self.nvml.nvmlDeviceGetCount()):
            h = self.nvml.nvmlDeviceGetHandleByIndex(i)
            attrs = {
                "hw.id": _text(self.nvml.nvmlDeviceGetUUID(h)),
                "hw.name": _text(self.nvml.nvmlDeviceGetName(h)),
                "hw.vendor": "NVIDIA",
                INDEX: i,
            }
            self.devices.append(Gpu(h, attrs))
        if not self.devices:
            note("kvscope: no GPU metrics (NVML sees no device)")

    def resource_attributes(self) -> dict[str, str]:
        """`kvscope.gpu.ids`: the UUIDs of the GPUs on this host (empty without a GPU)."""
        if not self.devices:
            return {}
        return {"kvscope.gpu.ids": ",".join(d.attributes["hw.id"] for d in self.devices)}

    def register(self, meter: Meter) -> None:
        """Create the GPU gauges on meter (none without a GPU)."""
        if not self.devices:
            return
        from opentelemetry.metrics import Observation

        self._observation = Observation
        gauges = (
            ("hw.gpu.memory.limit", "By", "GPU memory size (NVML total).", self._limit),
            (
                "hw.gpu.memory.usage",
                "By",
                "GPU memory used, all processes (NVML used).",
                self._usage,
            ),
            ("kvscope.gpu.memory.free", "By", "GPU memory free (NVML free).", self._free),
            ("hw.gpu.memory.utilization", "1", "Fraction of GPU memory used.", self._mem_util),
            (
                "hw.gpu.utilization",
                "1",
                "Fraction of time a kernel ran (NVML gpu utilization).",
                self._util,
            ),
        )
        for name, unit, description, read in gauges:
            meter.create_observable_gauge(
                name, callbacks=[self._callback(read)], unit=unit, description=description
            )

    def _callback(
        self, read: Callable[[Any], float]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            out = []
            for d in self.devices:
                try:
                    out.append(self._observation(read(d.handle), d.attributes))
                except Exception:  # noqa: BLE001 - a device that fell off the bus: skip it
                    continue
            return out

        return observe

    def _limit(self, h: Any) -> float:
        return int(memory_info(self.nvml, h).total)

    def _usage(self, h: Any) -> float:
        return int(memory_info(self.nvml, h).used)

    def _free(self, h: Any) -> float:
        return int(memory_info(self.nvml, h).free)

    def _mem_util(self, h: Any) -> float:
        m = memory_info(self.nvml, h)
        return int(m.used) / int(m.total) if int(m.total) else 0.0

    def _util(self, h: Any) -> float:
        return self.nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0

    def close(self) -> None:
        """Shut NVML down (once)."""
        if self.nvml is not None:
            self.nvml.nvmlShutdown()
            self.nvml = None
            self.devices = []


def memory_info(nvml: Any, h: Any) -> Any:
    """NVML's memory reading, version 2 where the binding has it: its `used` leaves out the
    memory the driver reserves, as nvidia-smi's does (version 1 counts it as used: on an H200,
    about 600 MiB more)."""
    v2 = getattr(nvml, "nvmlMemory_v2", None)
    if v2 is not None:
        try:
            return nvml.nvmlDeviceGetMemoryInfo(h, version=v2)
        except Exception:  # noqa: BLE001 - a driver without v2: fall back to v1
            pass
    return nvml.nvmlDeviceGetMemoryInfo(h)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def nvml_index(device: str) -> int:
    """The NVML index of a torch device string (`cuda`, `cuda:N`), through CUDA_VISIBLE_DEVICES
    when it lists indices (NVML ignores it and numbers every GPU on the host)."""
    _, _, tail = device.partition(":")
    index = int(tail) if tail else 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    if visible and all(v.isdigit() for v in visible) and index < len(visible):
        return int(visible[index])
    return index


def _open(nvml: Any) -> Any:
    """NVML initialised (pynvml when `nvml` is None), or None without a driver or binding."""
    try:
        if nvml is None:
            import pynvml

            nvml = pynvml
        nvml.nvmlInit()
    except Exception:  # noqa: BLE001 - ImportError or any NVMLError: nothing to show
        return None
    return nvml


def _read(nvml: Any, device: str) -> dict[str, Any] | None:
    """One reading of the GPU behind `device` through an initialised NVML."""
    try:
        index = nvml_index(device)
        if index >= nvml.nvmlDeviceGetCount():
            return None
        h = nvml.nvmlDeviceGetHandleByIndex(index)
        m = memory_info(nvml, h)
        return {
            "index": index,
            "name": _text(nvml.nvmlDeviceGetName(h)),
            "uuid": _text(nvml.nvmlDeviceGetUUID(h)),
            "used": int(m.used),
            "total": int(m.total),
            "free": int(m.free),
        }
    except Exception:  # noqa: BLE001 - a device that fell off the bus: nothing to show
        return None


def gpu_memory(device: str, nvml: Any = None) -> dict[str, Any] | None:
    """NVML's memory reading of the GPU behind a torch device string; None without NVML, a GPU
    of that index, or for the CPU."""
    if not device.startswith("cuda"):
        return None
    nvml = _open(nvml)
    if nvml is None:
        return None
    try:
        return _read(nvml, device)
    finally:
        nvml.nvmlShutdown()


class GpuMemoryReader:
    """`gpu_memory` of one device for a display that refreshes often (`kvscope top`): NVML
    stays initialised, and it is read at most every `every_s` seconds (the last reading is
    returned in between). `read()` is None without NVML or that GPU."""

    def __init__(
        self,
        device: str,
        nvml: Any = None,
        every_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert device.startswith("cuda"), device
        self.device = device
        self.every_s = every_s
        self.clock = clock
        self.nvml = _open(nvml)
        self.last: dict[str, Any] | None = None
        self.read_at = -float("inf")
        self.num_reads = 0

    def read(self) -> dict[str, Any] | None:
        if self.nvml is None:
            return None
        now = self.clock()
        if now - self.read_at >= self.every_s:
            self.read_at = now
            self.last = _read(self.nvml, self.device)
            self.num_reads += 1
        return self.last

    def close(self) -> None:
        """Shut NVML down (once)."""
        if self.nvml is not None:
            self.nvml.nvmlShutdown()
            self.nvml = None
