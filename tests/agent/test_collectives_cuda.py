"""CUDA timing of collectives, with stand-in events (this machine has no GPU).

A CUDA future (NCCL's) completes, and runs its callbacks, as soon as its op is enqueued; only
events on the streams it hands its callbacks order after the op's kernels. These tests check
that every op on a CUDA tensor is timed by a launch event and an end event recorded where its
completion is observed, on the op's own device, resolved without blocking at step boundaries.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import vigil.agent
from vigil import codec, schema
from vigil.agent import collectives, ddp_hook, patching

DEVICE = 3


class _CudaLike(torch.Tensor):
    """A CPU tensor that says it lives on CUDA device 3."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def get_device(self) -> int:
        return DEVICE


class _Event:
    """Stands in for torch.cuda.Event: stamped with the device clock when recorded."""

    def __init__(self, device_time: float, device: int) -> None:
        self.time = device_time
        self.device = device
        self.done = True

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: _Event) -> float:
        return (end.time - self.time) * 1000.0  # milliseconds, as CUDA reports


class _Device:
    def __init__(self) -> None:
        self.time = 0.0
        self.events: list[_Event] = []
        self.guarded: list[int] = []  # devices made current to read events

    def record(self, device: int) -> _Event:
        event = _Event(self.time, device)
        self.events.append(event)
        return event

    def guard(self, device: int) -> contextlib.AbstractContextManager[None]:
        self.guarded.append(device)
        return contextlib.nullcontext()


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Device]:
    fake = _Device()
    monkeypatch.setattr(collectives, "_cuda_event", fake.record)
    monkeypatch.setattr(collectives, "_device_guard", fake.guard)
    yield fake


def _recorder(cpu: list[float]) -> collectives.CollectiveRecorder:
    return collectives.CollectiveRecorder(page=None, on_error=_raise, clock=lambda: cpu[0])


def _raise(exc: BaseException) -> None:
    raise exc


def _tensor() -> torch.Tensor:
    return torch.ones(256).as_subclass(_CudaLike)


def test_async_op_is_timed_on_the_device_not_at_its_inline_callback(device: _Device) -> None:
    cpu = [100.0]
    recorder = _recorder(cpu)
    pending = recorder.begin("all_reduce", None, _tensor(), None, blocking=False)
    device.time = 0.25  # the kernels run after the CPU has moved on
    recorder.finish(pending, sync=False)  # the future's callback: at once, CPU clock unchanged
    aggs, blocked, total = recorder.swap()
    ((site, agg),) = aggs.items()
    assert (site.op, agg.count, agg.nbytes) == ("all_reduce", 1, 256 * 4)
    assert agg.total_s == pytest.approx(0.25)
    assert total == pytest.approx(0.25)
    assert blocked == 0.0  # nothing blocked the training thread
    assert [e.device for e in device.events] == [DEVICE, DEVICE]
    assert device.guarded == [DEVICE]  # events are read with their own device current


def test_an_op_still_on_the_device_at_its_step_end_counts_in_its_own_step(
    device: _Device,
) -> None:
    cpu = [0.0]
    recorder = _recorder(cpu)
    recorder.step = 7
    pending = recorder.begin("all_gather_into_tensor", None, _tensor(), None, blocking=False)
    device.time = 0.5
    recorder.finish(pending, sync=False)
    device.events[-1].done = False  # still running on the device when step 7 ends
    step7, _, total = recorder.swap()
    assert step7 == {} and total == 0.0
    assert not recorder.release(7)  # its records must wait
    recorder.step = 8
    device.events[-1].done = True
    done = threading.Thread(target=recorder.resolve_cuda)  # the flusher's thread
    done.start()
    done.join()
    assert recorder.release(7)
    ((_, agg),) = step7.items()
    assert agg.count == 1 and agg.total_s == pytest.approx(0.5)
    assert recorder.swap()[0] == {}  # not counted again in step 8


def test_release_can_be_forced_and_later_completions_count_in_the_current_step(
    device: _Device,
) -> None:
    recorder = _recorder([0.0])
    recorder.step = 1
    pending = recorder.begin("all_reduce", None, _tensor(), None, blocking=False)
    device.time = 0.25
    recorder.finish(pending, sync=False)
    device.events[-1].done = False
    step1, _, _ = recorder.swap()
    assert recorder.release(1, force=True)
    recorder.step = 2
    device.events[-1].done = True
    step2, _, _ = recorder.swap()
    assert step1 == {}
    ((_, agg),) = step2.items()
    assert agg.total_s == pytest.approx(0.25)


def test_sync_op_blocks_on_the_cpu_clock_and_lasts_on_the_device_clock(device: _Device) -> None:
    cpu = [10.0]
    recorder = _recorder(cpu)
    pending = recorder.begin("broadcast", None, [_tensor(), _tensor()], None, blocking=True)
    device.time, cpu[0] = 0.125, 10.002
    recorder.finish(pending, sync=True)
    aggs, blocked, _ = recorder.swap()
    ((_, agg),) = aggs.items()
    assert agg.nbytes == 2 * 256 * 4
    assert agg.total_s == pytest.approx(0.125)
    assert blocked == pytest.approx(0.002)


def test_session_holds_a_steps_records_until_its_device_collectives_end(
    device: _Device, tmp_path: Path
) -> None:
    """The flusher builds a step's records once its ops have ended on the device, so their
    device time counts in the step that launched them, not in a later one."""
    session = vigil.agent.init(
        job="unit",
        output_dir=tmp_path / "out",
        progress_dir=tmp_path / "pages",
        rank=0,
        world_size=1,
        measure_cpu_peak=False,
        flush_interval_s=60.0,  # the test runs the flusher's settling itself
    )
    assert session is not None
    try:
        with vigil.agent.step(0, tokens=1):
            pending = session.recorder.begin("all_reduce", None, _tensor(), None, blocking=False)
            device.time = 0.5
            session.recorder.finish(pending, sync=False)
            device.events[-1].done = False  # the GPU is behind when the step ends
        with vigil.agent.step(1, tokens=1):
            pass
        session.background.settle()
        assert [e.step for e in session._ended] == [0, 1]  # held, in order
        device.events[-1].done = True
        session.background.settle()
        assert not session._ended
    finally:
        vigil.agent.shutdown()
    path = tmp_path / "out" / "unit" / "rank-00000.jsonl"
    records = [codec.decode_json(line) for line in path.read_bytes().splitlines()]
    aggs = [r for r in records if isinstance(r, schema.CollectiveAggregate)]
    assert [(a.step, a.op, a.count) for a in aggs] == [(0, "all_reduce", 1)]
    assert aggs[0].total_device_s == pytest.approx(0.5)
    assert sorted(r.step for r in records if isinstance(r, schema.StepRecord)) == [0, 1]


class _Group:
    group_desc, group_name = "dp", "7"

    def size(self) -> int:
        return 2

    def allreduce(self, tensors: list[torch.Tensor], options: Any) -> Any:
        return _Work(tensors)


class _Work:
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        self._future.set_result(tensors)  # complete at enqueue, as NCCL's future is

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future


class _Bucket:
    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def buffer(self) -> torch.Tensor:
        return self._tensor


def test_ddp_hook_on_a_future_that_completes_at_enqueue(
    device: _Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = [5.0]
    recorder = _recorder(cpu)
    monkeypatch.setattr(patching, "_active", recorder)
    tensor = _tensor()
    device.time = 1.0
    start_events = len(device.events)
    # The callback runs inline while the hook returns; the device is still busy then.
    original_record = device.record

    def record(dev: int) -> _Event:
        event = original_record(dev)
        device.time += 0.75  # the all-reduce's kernels run after the launch event
        return event

    monkeypatch.setattr(collectives, "_cuda_event", record)
    fut = ddp_hook.ddp_comm_hook(_Group(), _Bucket(tensor))
    assert fut.value() is tensor
    assert torch.equal(tensor, torch.full((256,), 0.5))  # divided for the average (a SUM op)
    aggs, _, _ = recorder.swap()
    ((site, agg),) = aggs.items()
    assert (site.group, site.op, agg.count, agg.last_seq) == ("dp:7", "ddp_all_reduce", 1, 1)
    assert site.overlapped and agg.last_s == pytest.approx(0.75)
    assert agg.total_s == pytest.approx(0.75)
    assert len(device.events) == start_events + 2


def test_size_reads_the_device_of_a_tensor_list() -> None:
    assert collectives._size([torch.ones(2), _tensor()]) == (2 * 4 + 256 * 4, b"float32", DEVICE)
    assert collectives._size([torch.ones(2)])[2] == -1
    assert collectives._size(None) == (0, b"", -1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nccl_async_all_reduce_is_timed_with_real_events(tmp_path: Any) -> None:
    """On a GPU machine: NCCL's future completes at enqueue; the op still gets a device time
    from real events, resolved at the step boundary once the device is done."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        store = dist.FileStore(str(tmp_path / "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    # A one-member NCCL group of this process, whatever group this process already has.
    group = dist.new_group([dist.get_rank()], backend="nccl", use_local_synchronization=True)
    recorder = collectives.CollectiveRecorder(page=None, on_error=_raise)
    try:
        patching.install(recorder)
        x = torch.ones(64 << 20, device="cuda")
        dist.all_reduce(x, group=group, async_op=True).wait()
        torch.cuda.synchronize()
        aggs, _, total = recorder.swap()
    finally:
        patching.uninstall()
        dist.destroy_process_group(None if created else group)
    ((site, agg),) = aggs.items()
    assert (site.op, agg.count, agg.nbytes) == ("all_reduce", 1, x.nbytes)
    assert total > 0.0
    assert not recorder._cuda_pending
