"""The GPUs of this machine, as the heartbeat reports them.

Found through NVML (``pynvml``), else ``nvidia-smi``, else declared by ``--gpus N --gpu-memory
GB``. Indices are NVML's, the PCI bus order, as the engine is started with
``CUDA_DEVICE_ORDER=PCI_BUS_ID``; memory in use counts every process's, ours included.
Detection runs in the heartbeat loop, so it is bounded (REFRESH_SECONDS, SMI_TIMEOUT_SECONDS,
SMI_RETRY_SECONDS) and the last reading is reported between. This module must not import Django.
"""

from __future__ import annotations

import logging
import math
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from llmgw.engine import run_bounded

log = logging.getLogger("llmgw.node")

MAX_DEVICES = 64  # the contract's bound on a heartbeat's devices
MAX_UUID = 100
MAX_NAME = 200
REFRESH_SECONDS = 5.0
SMI_TIMEOUT_SECONDS = 5.0
SMI_MAX_BYTES = 64 * 1024
SMI_RETRY_SECONDS = 60.0
SMI_QUERY = [
    "--query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu",
    "--format=csv,noheader,nounits",
]

Device = dict[str, Any]


def device(
    index: int,
    uuid: str,
    name: str,
    memory_total_mb: int,
    memory_used_mb: int,
    utilization_pct: int | None,
) -> Device:
    """One device as the heartbeat carries it (the contract's shape), clipped to its bounds."""
    return {
        "index": index,
        "uuid": uuid[:MAX_UUID],
        "name": name[:MAX_NAME],
        "memory_total_mb": max(0, memory_total_mb),
        "memory_used_mb": max(0, memory_used_mb),
        "utilization_pct": None if utilization_pct is None else min(100, max(0, utilization_pct)),
    }


def declared_devices(gpus: int, gpu_memory_gb: float) -> list[Device]:
    """The devices ``--gpus N --gpu-memory GB`` declare: N alike, nothing known but their size."""
    memory_mb = int(gpu_memory_gb * 1024)
    return [device(i, "", "declared", memory_mb, 0, None) for i in range(min(gpus, MAX_DEVICES))]


def capacity(devices: list[Device]) -> tuple[int, float]:
    """(gpus, gpu_memory_gb) as the capacity reports them: the number of devices and the
    smallest one's memory, since a profile's gpu_memory_gb asks that much of each device."""
    if not devices:
        return 0, 0
    smallest = min(d["memory_total_mb"] for d in devices)
    return len(devices), round(smallest / 1024, 2)


# -- NVML ---------------------------------------------------------------------------------------


def load_nvml() -> Any | None:
    """The ``pynvml`` module, or None when the package is not installed."""
    try:
        # Here: the package is optional (nvidia-smi serves without it).
        import pynvml  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError:
        return None
    return pynvml


def _text(value: Any) -> str:
    # Older pynvml versions answer bytes, newer ones str.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def read_nvml(nvml: Any) -> list[Device]:
    """Every device NVML sees (nvmlInit already called). An NVML error on one query of a
    device that answers the others (utilisation is not supported everywhere) leaves that
    figure out; an error on the count or the memory raises (the caller falls back)."""
    found = []
    for index in range(min(int(nvml.nvmlDeviceGetCount()), MAX_DEVICES)):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        except nvml.NVMLError:
            uuid = ""
        try:
            name = _text(nvml.nvmlDeviceGetName(handle))
        except nvml.NVMLError:
            name = ""
        try:
            utilization: int | None = int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except nvml.NVMLError:
            utilization = None
        found.append(
            device(
                index,
                uuid,
                name,
                int(memory.total) // (1 << 20),
                int(memory.used) // (1 << 20),
                utilization,
            )
        )
    return found


# -- nvidia-smi ---------------------------------------------------------------------------------


def _whole(text: str) -> int | None:
    """A whole number from nvidia-smi ("81559", "37.5" → 37), None for "[N/A]" and the like."""
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if math.isfinite(value) and value >= 0 else None


def parse_nvidia_smi(output: str) -> list[Device]:
    """The devices in ``nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,
    utilization.gpu --format=csv,noheader,nounits`` output. A line that is not one device
    (a warning, a truncated line, garbage) is skipped and said in the log; "[N/A]"
    utilisation is None."""
    found: list[Device] = []
    seen: set[int] = set()
    for line in output.splitlines():
        if not line.strip():
            continue
        fields = [part.strip() for part in line.split(",")]
        # A GPU's name may hold a comma: the fields around it are fixed.
        if len(fields) >= 6:
            index, uuid, total, used, utilization = (
                _whole(fields[0]),
                fields[1],
                _whole(fields[-3]),
                _whole(fields[-2]),
                _whole(fields[-1]),
            )
            name = ", ".join(fields[2:-3])
            if (
                index is not None
                and index not in seen
                and total is not None
                and used is not None
                and len(uuid) <= MAX_UUID
                and uuid.isprintable()
            ):
                seen.add(index)
                found.append(device(index, uuid, name, total, used, utilization))
                if len(found) >= MAX_DEVICES:
                    break
                continue
        log.warning("nvidia-smi printed a line that is not a GPU; skipped: %r", line[:200])
    return found


def run_nvidia_smi(executable: str, *, timeout: float = SMI_TIMEOUT_SECONDS) -> list[Device]:
    """The devices nvidia-smi reports. Raises OSError (it cannot run), TimeoutExpired (it hangs:
    it is killed) or CalledProcessError (it failed). At most SMI_MAX_BYTES of its output is read;
    the rest is dropped (and the cut last line skipped)."""
    code, output = run_bounded(
        [executable, *SMI_QUERY], timeout=timeout, max_bytes=SMI_MAX_BYTES, stderr=False
    )
    if code != 0:
        raise subprocess.CalledProcessError(code, executable)
    text = output.decode(errors="replace")
    if len(output) >= SMI_MAX_BYTES:
        text = text[: text.rfind("\n") + 1]
    return parse_nvidia_smi(text)


# -- the detector the agent holds ---------------------------------------------------------------


class GpuDetector:
    """This machine's GPUs, read at most every ``refresh`` seconds.

    ``nvml`` is the NVML module to use (a test passes a fake with the same functions); by
    default ``pynvml`` if installed. ``nvidia_smi`` is the executable (default: found on PATH
    at each reading). ``declared`` is ``(gpus, gpu_memory_gb)`` from the command line, which
    replaces detection."""

    def __init__(
        self,
        *,
        nvml: Any | None = None,
        use_nvml: bool = True,
        nvidia_smi: str | None = None,
        declared: tuple[int, float] | None = None,
        refresh: float = REFRESH_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.declared = declared
        self.refresh = refresh
        self.clock = clock
        self._nvml_module = nvml
        self._use_nvml = use_nvml
        self._nvml_state = "untried"  # "ready" once nvmlInit succeeded, "unusable" if it failed
        self._nvidia_smi = nvidia_smi
        self._smi_failed_at: float | None = None
        self._read_at: float | None = None
        self._last: tuple[list[Device], str] = ([], "")
        self._lock = threading.Lock()
        self._said: str | None = None

    def devices(self) -> tuple[list[Device], str]:
        """(devices, source): source is "nvml", "nvidia-smi", "flags", or "" when none found."""
        if self.declared is not None:
            return declared_devices(*self.declared), "flags"
        with self._lock:
            now = self.clock()
            if self._read_at is None or now - self._read_at >= self.refresh:
                self._last = self._read(now)
                self._read_at = now
            devices, source = self._last
            return [dict(d) for d in devices], source

    def _read(self, now: float) -> tuple[list[Device], str]:
        nvml = self._nvml()
        if nvml is not None:
            try:
                return read_nvml(nvml), "nvml"
            except nvml.NVMLError as exc:
                self._say(f"NVML could not read the GPUs ({exc}); asking nvidia-smi instead")
        return self._read_smi(now)

    def _nvml(self) -> Any | None:
        """The NVML module once initialised (initialised once; None when it cannot be)."""
        if self._nvml_state == "ready":
            return self._nvml_module
        if self._nvml_state == "unusable" or not self._use_nvml:
            return None
        self._nvml_state = "unusable"
        module = self._nvml_module or load_nvml()
        if module is None:
            return None
        try:
            module.nvmlInit()
        except module.NVMLError as exc:
            # No driver (this is where a machine without an NVIDIA GPU ends up) or no library.
            log.info("NVML is not usable here (%s); GPUs are looked for with nvidia-smi", exc)
            return None
        self._nvml_module, self._nvml_state = module, "ready"
        return module

    def _read_smi(self, now: float) -> tuple[list[Device], str]:
        executable = self._nvidia_smi or shutil.which("nvidia-smi")
        if executable is None:
            return [], ""
        if self._smi_failed_at is not None and now - self._smi_failed_at < SMI_RETRY_SECONDS:
            return self._last  # what it said last, rather than GPUs that vanish and come back
        try:
            found = run_nvidia_smi(executable, timeout=SMI_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            self._smi_failed(now, f"nvidia-smi did not answer within {SMI_TIMEOUT_SECONDS:g} s")
            return self._last
        except (OSError, subprocess.CalledProcessError) as exc:
            self._smi_failed(now, f"nvidia-smi failed ({exc})")
            return [], ""
        self._smi_failed_at = None
        return found, ("nvidia-smi" if found else "")

    def _smi_failed(self, now: float, text: str) -> None:
        self._smi_failed_at = now
        self._say(f"{text}; trying it again in {SMI_RETRY_SECONDS:g} s")

    def _say(self, text: str) -> None:
        if text != self._said:
            log.warning("%s", text)
            self._said = text
