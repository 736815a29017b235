"""GPU memory from NVML beside the pool's bytes; without a GPU, one info line and no GPU metrics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kvscope.probes.nvml import GpuMemoryReader, GpuMetrics

GIB = 1 << 30


def collect(gpus: GpuMetrics) -> dict[str, object]:
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    gpus.register(mp.get_meter("test"))
    data = reader.get_metrics_data()
    mp.shutdown()
    if data is None:
        return {}
    return {
        m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    }


def test_without_nvml_one_info_line_and_no_gpu_metrics():
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has a working NVML")
    except Exception:  # noqa: BLE001 - pynvml missing or NVMLError: the path under test
        pass
    # GIVEN no GPU driver WHEN the GPU reader starts
    lines: list[str] = []
    gpus = GpuMetrics(note=lines.append)
    # THEN it says so once, exports nothing and adds no resource attribute
    assert len(lines) == 1 and lines[0].startswith("kvscope: no GPU metrics")
    assert gpus.devices == [] and gpus.resource_attributes() == {}
    assert collect(gpus) == {}
    gpus.close()


class FakeNvml:
    """The few pynvml calls GpuMetrics makes, for one 80 GiB GPU with 60 GiB used."""

    shutdowns = 0

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        pass

    def nvmlShutdown(self) -> None:  # noqa: N802
        FakeNvml.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:  # noqa: N802
        return f"h{i}"

    def nvmlDeviceGetUUID(self, h: str) -> str:  # noqa: N802
        return "GPU-1234"

    def nvmlDeviceGetName(self, h: str) -> bytes:  # noqa: N802
        return b"NVIDIA H200"

    def nvmlDeviceGetMemoryInfo(self, h: str) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(total=80 * GIB, used=60 * GIB, free=20 * GIB)

    def nvmlDeviceGetUtilizationRates(self, h: str) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(gpu=35, memory=10)


def test_gpu_memory_and_utilization_with_hardware_attributes():
    # GIVEN an NVML that sees one GPU
    gpus = GpuMetrics(nvml=FakeNvml(), note=pytest.fail)
    m = collect(gpus)
    # THEN total / used / free and utilization are gauges with the device's attributes
    want = {
        "hw.gpu.memory.limit": ("By", 80 * GIB),
        "hw.gpu.memory.usage": ("By", 60 * GIB),
        "kvscope.gpu.memory.free": ("By", 20 * GIB),
        "hw.gpu.memory.utilization": ("1", 0.75),
        "hw.gpu.utilization": ("1", 0.35),
    }
    assert set(m) == set(want)
    for name, (unit, v) in want.items():
        (p,) = m[name].data.data_points
        assert (m[name].unit, p.value) == (unit, pytest.approx(v)), name
        assert dict(p.attributes) == {
            "hw.id": "GPU-1234",
            "hw.name": "NVIDIA H200",
            "hw.vendor": "NVIDIA",
            "kvscope.gpu.index": 0,
        }
    assert gpus.resource_attributes() == {"kvscope.gpu.ids": "GPU-1234"}
    gpus.close()
    gpus.close()
    assert FakeNvml.shutdowns == 1


def test_the_reader_for_top_reads_nvml_at_most_once_a_second():
    # GIVEN a reader of cuda:0 on a clock the test moves
    now = [100.0]
    shutdowns = FakeNvml.shutdowns
    reader = GpuMemoryReader("cuda:0", nvml=FakeNvml(), every_s=1.0, clock=lambda: now[0])
    # WHEN it is read three times within a second, then once after
    first = reader.read()
    now[0] += 0.5
    assert reader.read() == first
    now[0] += 0.4
    reader.read()
    assert reader.num_reads == 1
    now[0] += 0.2
    reader.read()
    # THEN NVML was read twice, and the reading is the GPU's memory
    assert reader.num_reads == 2
    assert first == {
        "index": 0,
        "name": "NVIDIA H200",
        "uuid": "GPU-1234",
        "used": 60 * GIB,
        "total": 80 * GIB,
        "free": 20 * GIB,
    }
    # AND closing shuts NVML down once
    reader.close()
    reader.close()
    assert FakeNvml.shutdowns == shutdowns + 1 and reader.read() is None


def test_the_reader_of_a_gpu_nvml_does_not_see_reads_none():
    # GIVEN NVML with one GPU, WHEN the reader asks for cuda:3, THEN there is nothing to show
    reader = GpuMemoryReader("cuda:3", nvml=FakeNvml())
    assert reader.read() is None
    reader.close()
