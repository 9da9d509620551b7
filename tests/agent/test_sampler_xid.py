"""XID events are counted on the GPU they name, with handles shaped like nvidia-ml-py's.

nvidia-ml-py's device handles are ctypes pointers into the driver's memory: each call (and each
read of an event's `device` field) returns a fresh pointer object, and ctypes pointers compare
by identity. The stand-in below hands out exactly such pointers (pynvml's own types over a
buffer standing in for driver memory), so a sampler comparing handles with `==` counts nothing.
"""

# ruff: noqa: N802, N815 - the stand-in mirrors nvidia-ml-py's names
from __future__ import annotations

import ctypes
from collections import deque
from typing import Any

import pynvml

from vigil.agent import sampler


class _XidNvml:
    """Two GPUs that only know their UUIDs and deliver queued XID events."""

    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError

    def __init__(self) -> None:
        self._driver = (ctypes.c_uint64 * 2)()  # where the driver's device structs would live
        self.registered: list[int] = []
        self.pending: deque[tuple[int, int]] = deque()  # (device address, XID)

    def _address(self, index: int) -> int:
        return ctypes.addressof(self._driver) + index * ctypes.sizeof(ctypes.c_uint64)

    def handle(self, index: int) -> Any:
        """A fresh pointer object to device `index`, as nvmlDeviceGetHandleByIndex returns."""
        return ctypes.cast(self._address(index), pynvml.c_nvmlDevice_t)

    def _index(self, handle: Any) -> int:
        address = ctypes.cast(handle, ctypes.c_void_p).value
        return [self._address(i) for i in range(2)].index(address)

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return self.handle(index)

    def nvmlDeviceGetUUID(self, handle: Any) -> bytes:
        return f"GPU-{self._index(handle)}".encode()

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle: Any, kinds: int, events: str) -> None:
        self.registered.append(self._index(handle))

    def nvmlEventSetWait_v2(self, events: str, timeout_ms: int) -> Any:
        if not self.pending:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        address, xid = self.pending.popleft()
        data = pynvml.c_nvmlEventData_t()
        data.device = ctypes.cast(address, pynvml.c_nvmlDevice_t)
        data.eventType = self.nvmlEventTypeXidCriticalError
        data.eventData = xid
        return data


def _xid_readings(gpus: sampler.NvmlSampler) -> dict[str, float]:
    return {r.device: r.value for r in gpus.sample() if r.name == "xid_events"}


def test_each_xid_is_counted_on_the_gpu_its_event_names() -> None:
    nvml = _XidNvml()
    gpus = sampler.NvmlSampler(nvml)
    assert nvml.registered == [0, 1]
    assert nvml.handle(1) is not nvml.handle(1)  # fresh pointers, as nvidia-ml-py returns
    nvml.pending.extend([(nvml._address(1), 79), (nvml._address(1), 48), (nvml._address(0), 94)])

    assert _xid_readings(gpus) == {"GPU-0": 1.0, "GPU-1": 2.0}
    assert gpus.xid_counts == [1, 2]


def test_an_xid_on_a_device_the_agent_does_not_sample_is_not_counted() -> None:
    nvml = _XidNvml()
    gpus = sampler.NvmlSampler(nvml)
    elsewhere = ctypes.c_uint64()
    nvml.pending.extend([(ctypes.addressof(elsewhere), 79), (nvml._address(0), 13)])

    assert _xid_readings(gpus) == {"GPU-0": 1.0, "GPU-1": 0.0}
