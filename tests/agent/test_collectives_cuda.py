"""CUDA timing of collectives: the recorder's bookkeeping on CPU, the streams on a GPU.

A CUDA future (NCCL's) completes, and runs its callbacks, as soon as its op is enqueued; only
events on the streams it hands its callbacks order after the op's kernels. The recorder times
every op on a CUDA tensor by a launch event on the issuing stream and an end event on the stream
current where its completion is observed, on the op's own device, read without blocking.

The CPU tests (`test_bookkeeping_*`) replace vigil's two event functions (`stream_event`,
`_device_guard`) with stand-ins stamped by a settable device clock, on a CPU tensor that says it
lives on CUDA device 3: they check what the recorder does with an event pair (durations, the step
an op counts in, holding and releasing steps, blocked time, the device made current), and cannot
see which stream an event goes on. The GPU test checks that with real events and NCCL.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

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
    """Stands in for torch.cuda.Event: stamped with the settable device clock when recorded (on
    no stream at all)."""

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
    monkeypatch.setattr(collectives, "stream_event", fake.record)
    monkeypatch.setattr(collectives, "_device_guard", fake.guard)
    yield fake


def _recorder(cpu: list[float]) -> collectives.CollectiveRecorder:
    return collectives.CollectiveRecorder(page=None, on_error=_raise, clock=lambda: cpu[0])


def _raise(exc: BaseException) -> None:
    raise exc


def _session(tmp_path: Path) -> Any:
    """A one-rank session writing JSONL under tmp_path/out/unit; the test runs the flusher's
    settling itself."""
    session = vigil.agent.init(
        job="unit",
        output_dir=tmp_path / "out",
        progress_dir=tmp_path / "pages",
        rank=0,
        world_size=1,
        measure_cpu_peak=False,
        flush_interval_s=60.0,
    )
    assert session is not None
    return session


def _tensor() -> torch.Tensor:
    return torch.ones(256).as_subclass(_CudaLike)


def test_bookkeeping_async_op_lasts_its_event_pair_not_its_inline_callback(device: _Device) -> None:
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


def test_bookkeeping_an_op_still_on_the_device_at_its_step_end_counts_in_its_own_step(
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


def test_bookkeeping_release_can_be_forced_and_later_completions_count_in_the_current_step(
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


def test_bookkeeping_sync_op_exposes_its_device_time_not_the_hosts(device: _Device) -> None:
    """The host's time in a synchronous CUDA op can hold the rank's own queued kernels (gloo
    waits for the stream to reach the op): the op's device time is its exposed wait."""
    cpu = [10.0]
    recorder = _recorder(cpu)
    pending = recorder.begin("broadcast", None, [_tensor(), _tensor()], None, blocking=True)
    device.time, cpu[0] = 0.125, 10.2  # the host returned after 200 ms, the op took 125
    recorder.finish(pending, sync=True)
    aggs, blocked, _ = recorder.swap()
    ((_, agg),) = aggs.items()
    assert agg.nbytes == 2 * 256 * 4
    assert agg.total_s == pytest.approx(0.125)
    assert blocked == 0.0
    assert collectives.exposed_s(aggs) == pytest.approx(0.125)
    pending = recorder.begin("all_reduce", None, _tensor(), None, blocking=False)
    device.time += 0.5
    recorder.finish(pending, sync=False)  # an asynchronous op's time is not exposed wait
    assert collectives.exposed_s(recorder.swap()[0]) == 0.0


def test_bookkeeping_session_holds_a_steps_records_until_its_device_collectives_end(
    device: _Device, tmp_path: Path
) -> None:
    """The flusher builds a step's records once its ops have ended on the device, so their
    device time counts in the step that launched them, not in a later one."""
    session = _session(tmp_path)
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


def test_bookkeeping_a_waited_async_op_exposes_its_device_time_past_the_wait(
    device: _Device,
) -> None:
    """An asynchronous op that the training thread waits for exposes the device time from the
    waiting stream's event at the wait to the op's end; nothing when the op ended first, or
    when the stream got to the wait after the op's end; the host's wait is not counted."""
    cpu = [0.0]
    recorder = _recorder(cpu)
    # (stream reaches the wait at, the op ends at, the wait's event has completed)
    for wait_at, end_at, reached, exposed in [
        (0.1, 0.3, True, 0.2),  # the stream waited 0.2 s for the op
        (0.4, 0.3, True, 0.0),  # the op had ended when the stream got there
        (0.2, 0.3, False, 0.0),  # the stream is not there yet though the op has ended
    ]:
        device.time = 0.0
        pending = recorder.begin("all_gather_into_tensor", None, _tensor(), None, blocking=False)
        device.time = wait_at
        recorder.begin_device_wait(pending)
        device.events[-1].done = reached
        device.time = end_at
        recorder.finish(pending, sync=False)  # the future's callback, its stream after the op
        cpu[0] += 1.0
        recorder.wait_blocked(1.0, pending)  # the host's time in the wait
        aggs, blocked, _ = recorder.swap()
        assert blocked == 0.0
        assert collectives.exposed_s(aggs) == pytest.approx(exposed)
    # A wait that begins once the op's time has been read adds nothing.
    pending = recorder.begin("all_reduce", None, _tensor(), None, blocking=False)
    recorder.finish(pending, sync=False)
    recorder.resolve_cuda()
    events = len(device.events)
    recorder.begin_device_wait(pending)
    assert len(device.events) == events
    recorder.wait_blocked(0.5)  # a wait for an op the SDK does not know: the host's time
    assert recorder.swap()[1] == 0.5


def test_bookkeeping_step_record_wait_and_data_time_are_the_devices(
    device: _Device, tmp_path: Path
) -> None:
    """On CUDA a step's `comm_wait_s` is its synchronous ops' device time and its `data_s` the
    part of its data span the device was idle: a host blocked there while its own device
    finishes earlier work (a copy from pageable memory waits for the stream) is computing."""
    clock = [time.monotonic()]  # the session's clock, stepped by the test
    session = _session(tmp_path)
    session._cuda_device = DEVICE  # as after a first step on the GPU
    session._clock = session.recorder._clock = lambda: clock[0]
    try:
        for step, (busy, load) in enumerate([(0.030, 0.0), (0.0, 0.020)]):
            with vigil.agent.step(step, tokens=1):
                # Events are stamped when the stream reaches them: after `busy` s of queued work.
                device.time += busy
                with vigil.agent.span("data"):
                    clock[0] += busy + load  # the host waits for that work, then loads
                    device.time += load  # and copies
                pending = session.recorder.begin("all_reduce", None, _tensor(), None, blocking=True)
                device.time += 0.004
                clock[0] += 0.050  # the host is held far longer than the op
                session.recorder.finish(pending, sync=True)
                device.events[-1].done = step == 0  # step 1's op is still on the device
        session.background.settle()
        assert [e.step for e in session._ended] == [1]  # held until its events complete
        device.events[-1].done = True
    finally:
        vigil.agent.shutdown()
    path = tmp_path / "out" / "unit" / "rank-00000.jsonl"
    records = [codec.decode_json(line) for line in path.read_bytes().splitlines()]
    steps = sorted((r for r in records if isinstance(r, schema.StepRecord)), key=lambda r: r.step)
    assert [r.comm_wait_s for r in steps] == [pytest.approx(0.004), pytest.approx(0.004)]
    assert steps[0].data_s == pytest.approx(0.0)  # the host waited for its own device
    assert steps[1].data_s == pytest.approx(0.020)  # the device idled: a real stall


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


def test_bookkeeping_ddp_hook_on_a_future_that_completes_at_enqueue(
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

    monkeypatch.setattr(collectives, "stream_event", record)
    fut = ddp_hook.ddp_comm_hook(_Group(), _Bucket(tensor))
    assert fut.value() is tensor
    assert torch.equal(tensor, torch.full((256,), 0.5))  # divided for the average (a SUM op)
    aggs, _, _ = recorder.swap()
    ((site, agg),) = aggs.items()
    assert (site.group, site.op, agg.count, agg.last_seq) == ("dp:7", "ddp_all_reduce", 1, 1)
    assert site.overlapped and agg.last_s == pytest.approx(0.75)
    assert agg.total_s == pytest.approx(0.75)
    assert len(device.events) == start_events + 2


def test_bookkeeping_size_reads_the_device_of_a_tensor_list() -> None:
    assert collectives._size([torch.ones(2), _tensor()]) == (2 * 4 + 256 * 4, b"float32", DEVICE)
    assert collectives._size([torch.ones(2)])[2] == -1
    assert collectives._size(None) == (0, b"", -1)


# --- real events on a GPU -------------------------------------------------------------------

SPIN_S = 0.1  # a device-side delay far above launch gaps and the kernels of a 1-rank all-reduce
MARGIN_S = 0.01  # the 1-rank all-reduces and stream hand-offs after the spin: microseconds


def _cycles_for(seconds: float) -> int:
    """How many cycles `torch.cuda._sleep` spins for about `seconds` on this device now."""
    probe = 10_000_000
    torch.cuda._sleep(1000)  # loads the kernel
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * seconds / (start.elapsed_time(end) / 1000.0))


def _elapsed_s(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
    return start.elapsed_time(end) / 1000.0


def _why_no_nccl_gpu() -> str:
    if not torch.cuda.is_available():
        return "needs a CUDA device (real events and streams)"
    if not dist.is_nccl_available():
        return "needs NCCL (its streams' ordering is what is tested)"
    return ""


@pytest.mark.gpu
@pytest.mark.skipif(bool(_why_no_nccl_gpu()), reason=_why_no_nccl_gpu())
def test_nccl_collective_device_time_covers_a_spin_on_its_stream(tmp_path: Path) -> None:
    """Asynchronous NCCL ops of one group run in order on the group's own stream, and that
    stream first waits for the stream each op is issued from. A spin on a side stream, then op
    1 issued from it, holds the NCCL stream for the spin; op 2, issued from the default stream
    while the spin still runs, queues behind it there. So op 2's device time (its launch event
    on the default stream, its end event on the stream its completion callback runs on) covers
    the rest of the spin, and ends before later work on the default stream; op 1's launch event,
    on the side stream after the spin, leaves the spin out. Events on the wrong stream (the end
    recorded where the CPU is, or at a later wait; the launch on the default stream) break it."""
    created = not dist.is_initialized()
    if created:
        store = dist.FileStore(str(tmp_path / "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    # A one-member NCCL group of this process, whatever group this process already has.
    group = dist.new_group([dist.get_rank()], backend="nccl", use_local_synchronization=True)
    side = torch.cuda.Stream()
    x1, x2 = torch.ones(1 << 20, device="cuda"), torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x1, group=group)  # the communicator is set up before anything is timed
    torch.cuda.synchronize()
    cycles = _cycles_for(SPIN_S)
    spin_start, spin_end, launch_before, launch_after = (
        torch.cuda.Event(enable_timing=True) for _ in range(4)
    )
    recorder = collectives.CollectiveRecorder(page=None, on_error=_raise)
    try:
        patching.install(recorder)
        with torch.cuda.stream(side):
            spin_start.record()
            torch.cuda._sleep(cycles)
            spin_end.record()
            first = dist.all_reduce(x1, group=group, async_op=True)
        launch_before.record()
        second = dist.all_reduce(x2, group=group, async_op=True)
        launch_after.record()
        torch.cuda._sleep(cycles)  # later work on the issuing stream is not the collective's
        first.wait()
        second.wait()
        torch.cuda.synchronize()
        aggs, _, total = recorder.swap()
    finally:
        patching.uninstall()
        dist.destroy_process_group(None if created else group)
    ((site, agg),) = aggs.items()
    assert (site.op, agg.count, agg.nbytes) == ("all_reduce", 2, x1.nbytes + x2.nbytes)
    assert not recorder._cuda_pending
    second_s, first_s = agg.last_s, agg.total_s - agg.last_s  # last: the higher sequence number
    assert total == pytest.approx(first_s + second_s)
    spin_s = _elapsed_s(spin_start, spin_end)
    left_after_launch_s = _elapsed_s(launch_after, spin_end)
    assert left_after_launch_s > 0.5 * spin_s, "the spin ended before op 2 was launched"
    bound_s = _elapsed_s(launch_before, spin_end) + MARGIN_S
    assert left_after_launch_s - 1e-4 <= second_s <= bound_s, (second_s, spin_s)
    assert 0.0 <= first_s < 0.1 * spin_s, (first_s, spin_s)
