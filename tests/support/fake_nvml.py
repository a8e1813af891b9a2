"""A stand-in for the ``pynvml`` module (nvidia-ml-py) with the functions llmgw.node.gpus calls,
for unit tests of GPU detection on machines without a GPU. Each GPU is given as the figures NVML
would answer; ``fail`` names functions that raise NVMLError, as they do on a machine without a
driver (nvmlInit) or on a device that does not support a query (utilisation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


class NVMLError(Exception):
    pass


@dataclass
class FakeGpu:
    uuid: str
    name: str
    total_bytes: int
    used_bytes: int
    utilization: int | None = 0


@dataclass
class FakeNvml:
    gpus: list[FakeGpu]
    fail: set[str] = field(default_factory=set)
    calls: list[str] = field(default_factory=list)
    NVMLError: type[Exception] = NVMLError

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise NVMLError(f"{name}: Driver Not Loaded")

    def nvmlInit(self) -> None:  # pynvml's names
        self._call("nvmlInit")

    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._call("nvmlDeviceGetHandleByIndex")
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, gpu: FakeGpu) -> str:
        self._call("nvmlDeviceGetUUID")
        return gpu.uuid

    def nvmlDeviceGetName(self, gpu: FakeGpu) -> bytes:
        self._call("nvmlDeviceGetName")
        return gpu.name.encode()  # older pynvml answers bytes

    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu) -> Any:
        self._call("nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(
            total=gpu.total_bytes, used=gpu.used_bytes, free=gpu.total_bytes - gpu.used_bytes
        )

    def nvmlDeviceGetUtilizationRates(self, gpu: FakeGpu) -> Any:
        self._call("nvmlDeviceGetUtilizationRates")
        if gpu.utilization is None:
            raise NVMLError("Not Supported")
        return SimpleNamespace(gpu=gpu.utilization, memory=0)
