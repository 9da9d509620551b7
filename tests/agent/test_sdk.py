"""The public SDK in one process: no-ops before init, JSONL output, control, fail-open."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import vigil.agent
from vigil import codec, schema
from vigil.agent import ddp_hook, progress


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    yield tmp_path / "out", tmp_path / "pages"
    vigil.agent.shutdown()


def _init(dirs: tuple[Path, Path], **options: object) -> vigil.agent.Session:
    out, pages = dirs
    options.setdefault("measure_cpu_peak", False)
    options.setdefault("flush_interval_s", 0.05)
    session = vigil.agent.init(
        job="unit",
        output_dir=out,
        progress_dir=pages,
        rank=0,
        world_size=1,
        **options,
    )
    assert session is not None
    return session


def _records(out: Path) -> list[schema.Record]:
    path = out / "unit" / "rank-00000.jsonl"
    return [codec.decode_json(line) for line in path.read_bytes().splitlines()]


def _loop(steps: range, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for i in steps:
        with vigil.agent.span("data"):
            x = torch.randn(4, 16)
        with vigil.agent.step(i, tokens=4) as s:
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.set_loss(loss)


def test_each_step_record_has_its_own_spans(dirs: tuple[Path, Path]) -> None:
    """Records are built later, off the training thread: a span after a step ends (the next
    step's data loading) must not show up in that step's record."""
    _init(dirs, flush_interval_s=60.0)  # nothing is flushed until shutdown
    with vigil.agent.step(0, tokens=1):
        pass
    with vigil.agent.span("data"):
        time.sleep(0.02)
    with vigil.agent.step(1, tokens=1):
        pass
    with vigil.agent.step(2, tokens=1):
        pass
    vigil.agent.shutdown()
    data = {r.step: r.data_s for r in _records(dirs[0]) if isinstance(r, schema.StepRecord)}
    assert data[0] == 0.0 and data[1] >= 0.02 and data[2] == 0.0


def test_a_pipeline_span_counts_as_time_inside_a_pipeline_schedule(
    dirs: tuple[Path, Path],
) -> None:
    """A schedule of the user's own wrapped in `span("pipeline")`: its time, and none of the
    step's time outside it, is the record's `pipeline_s` (the analyzer compares the time
    outside with the stage's own earlier steps)."""
    _init(dirs)
    with vigil.agent.step(0, tokens=1):
        time.sleep(0.02)  # outside: data, the optimizer step
        with vigil.agent.span("pipeline"):
            time.sleep(0.05)
    with vigil.agent.step(1, tokens=1):
        time.sleep(0.01)
    vigil.agent.shutdown()
    steps = {r.step: r for r in _records(dirs[0]) if isinstance(r, schema.StepRecord)}
    inside = steps[0].pipeline_s
    assert 0.05 <= inside < 0.05 + 0.015 and inside < steps[0].step_time_s - 0.02
    assert steps[0].pipeline_comm_wait_s == 0.0  # no collective in there
    assert steps[1].pipeline_s == 0.0


def test_the_page_and_heartbeats_count_finished_checkpoint_spans(
    dirs: tuple[Path, Path],
) -> None:
    """A rank still in a save its peers finished is behind them (the analyzer's hang rule):
    the page says `checkpointing` during the span and counts each span that ended."""
    session = _init(dirs)
    reader = progress.PageReader(session.page.path)
    for done in range(2):
        with vigil.agent.step(done, tokens=1):
            pass
        with vigil.agent.span("checkpoint"):
            inside = reader.snapshot()
            assert (inside.state, inside.checkpoints) == (schema.RankState.CHECKPOINTING, done)
        after = reader.snapshot()
        assert (after.state, after.checkpoints) == (schema.RankState.COMPUTE, done + 1)
    with vigil.agent.span("data"):
        pass
    assert reader.snapshot().checkpoints == 2  # other spans are not counted
    vigil.agent.shutdown()
    beats = [r for r in _records(dirs[0]) if isinstance(r, schema.Heartbeat)]
    assert beats and beats[-1].checkpoints == 2


def test_the_page_and_heartbeats_say_when_the_loop_is_between_steps(
    dirs: tuple[Path, Path],
) -> None:
    """Between a step's end and the next one's start the training thread runs the loop's own
    code (an evaluation, a save): the page and the heartbeats say so, and a step clears it."""
    session = _init(dirs)
    reader = progress.PageReader(session.page.path)
    assert not reader.snapshot().between_steps  # not started yet
    with vigil.agent.step(0, tokens=1):
        assert not reader.snapshot().between_steps
        time.sleep(0.3)  # heartbeats from inside the step
    assert reader.snapshot().between_steps
    time.sleep(0.3)  # and from between steps
    with vigil.agent.step(1, tokens=1):
        assert not reader.snapshot().between_steps
    vigil.agent.shutdown()
    beats = [r for r in _records(dirs[0]) if isinstance(r, schema.Heartbeat)]
    flags = {(b.last_step, b.between_steps) for b in beats if b.state is schema.RankState.COMPUTE}
    assert (0, False) in flags and (0, True) in flags, flags


def test_the_page_says_while_torch_compile_compiles(dirs: tuple[Path, Path]) -> None:
    """A recompilation mid-run stops a step for seconds to minutes: once torch.compile is in
    use the page says `compiling` while it compiles (torch's compile callbacks), and no more
    after; the heartbeats carry it."""
    import torch._dynamo  # what torch.compile imports; the SDK waits for it

    session = _init(dirs)
    reader = progress.PageReader(session.page.path)

    def registered() -> bool:
        deadline = time.monotonic() + 10
        while not session._compiles.installed and time.monotonic() < deadline:
            time.sleep(0.02)  # registered on the flusher's next tick
        return session._compiles.installed

    assert registered()
    torch._dynamo.reset()  # clears every compile callback ...
    assert registered()  # ... and vigil's are registered again
    seen: list[tuple[bool, bool]] = []

    def during(*args: object) -> None:  # registered after vigil's: runs after it
        snap = reader.snapshot()
        seen.append((snap.compiling, snap.between_steps))

    handler = torch._dynamo.callback.callback_handler
    handler.register_start_callback(during)
    try:
        with vigil.agent.step(0, tokens=1):
            pass
        compiled = torch.compile(lambda x: (x * 2).sum(), backend="eager")
        compiled(torch.ones(3))  # between steps: compiles
    finally:
        handler.remove_start_callback(during)
    assert seen and seen[0] == (True, True), seen
    after = reader.snapshot()
    assert not after.compiling and after.between_steps
    vigil.agent.shutdown()
    assert not session._compiles.installed


def test_everything_is_a_cheap_no_op_before_init() -> None:
    assert vigil.agent.current() is None
    model = torch.nn.Linear(2, 2)
    vigil.agent.watch(model)
    vigil.agent.on_control("checkpoint", lambda: None)
    with vigil.agent.step(3, tokens=5) as s, vigil.agent.span("data"):
        s.set_loss(1.0)
    assert (s.step, s.tokens, s.loss) == (3, 5, 1.0)
    assert not model._forward_hooks
    vigil.agent.shutdown()


def test_bad_configuration_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        assert vigil.agent.init(job="a/b", rank=0, world_size=1) is None
        assert vigil.agent.init(job="x", rank=4, world_size=2) is None
    assert (
        "must not contain '/'" in caplog.text
        and "rank 4 must be in [0, world_size=2)" in caplog.text
    )
    assert vigil.agent.current() is None


def test_jsonl_output_has_identity_steps_phases_and_measured_flops(dirs: tuple[Path, Path]) -> None:
    _init(dirs, measure_flops=True, peak_flops=1e12)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    vigil.agent.watch(model, opt)
    _loop(range(5), model, opt)
    vigil.agent.shutdown()
    records = _records(dirs[0])
    assert isinstance(records[0], schema.RankInfo) and records[0].pid == os.getpid()
    assert isinstance(records[1], schema.Job) and records[1].peak_flops == 1e12
    steps = [r for r in records if isinstance(r, schema.StepRecord)]
    assert [s.step for s in steps] == [0, 1, 2, 3, 4]
    assert all(s.forward_s > 0 and s.backward_s > 0 and s.optimizer_s > 0 for s in steps)
    assert all(s.data_s > 0 and s.loss is not None and s.loss > 0 for s in steps)
    assert all(s.peak_memory_bytes > 10 * 2**20 for s in steps)  # this process's peak RSS
    # Counted once on step 0: forward GEMM + grad-weight GEMM, 2*16*16 FLOPs each per token.
    assert {s.model_flops for s in steps} == {4 * 2 * 2 * 16 * 16}
    assert all(s.mfu > 0 for s in steps)
    beats = [r for r in records if isinstance(r, schema.Heartbeat)]
    assert beats[-1].state is schema.RankState.FINISHED and beats[-1].last_step == 4


def test_control_requests_run_at_the_next_step_in_the_training_thread(
    dirs: tuple[Path, Path],
) -> None:
    session = _init(dirs)
    ran: list[tuple[str, int]] = []
    vigil.agent.on_control("checkpoint", lambda: ran.append(("ckpt", threading.get_ident())))
    vigil.agent.on_control("checkpoint", lambda: 1 / 0)  # a broken callback must not hurt
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _loop(range(2), model, opt)
    assert ran == []
    # As an operator would: `vigil agent --request` writes the request into the rank's page.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vigil",
            "agent",
            "--request",
            "checkpoint",
            "--job",
            "unit",
            "--progress-dir",
            str(dirs[1]),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "rank 0: checkpoint requested (#1)" in done.stdout
    reader = progress.PageReader(session.page.path)
    _loop(range(2, 3), model, opt)
    assert ran == [("ckpt", threading.get_ident())] and reader.acked() == 1
    assert session.internal_errors == 1
    reader.request_control("dump_stacks")
    _loop(range(3, 4), model, opt)
    stacks = session.page.path.with_suffix(".stacks").read_text()
    assert "dump_stacks requested" in stacks and "test_sdk.py" in stacks
    reader.close()


def test_stacks_on_signal_and_ring_dump_when_the_loop_stalls(dirs: tuple[Path, Path]) -> None:
    session = _init(dirs, min_hang_s=0.3, hang_factor=2.0)
    with vigil.agent.step(0):
        pass
    os.kill(os.getpid(), signal.SIGUSR1)
    stacks = session.page.path.with_suffix(".stacks")
    deadline = time.monotonic() + 5
    while "Current thread" not in stacks.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "test_stacks_on_signal" in stacks.read_text()
    with vigil.agent.step(1):
        time.sleep(1.0)  # no progress for longer than the 0.3 s threshold
    assert "no progress for" in stacks.read_text()
    vigil.agent.shutdown()  # a clean end: the run's folder goes with its stacks
    assert not stacks.exists() and not session.run_dir.exists()


def test_internal_errors_are_counted_and_training_goes_on(dirs: tuple[Path, Path]) -> None:
    session = _init(dirs)

    def broken() -> None:
        raise RuntimeError("recorder broke")

    session.recorder.swap = broken  # type: ignore[method-assign, assignment]
    done = []
    for i in range(3):
        with vigil.agent.step(i):
            done.append(i)
    assert done == [0, 1, 2] and session.internal_errors == 3


def test_the_ddp_hook_lets_nccl_average_and_divides_first_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NCCL averages in its kernel (no extra pass over the bucket); gloo and unknown groups sum
    a bucket the hook has divided by the group size first."""

    class Group:  # stands in for a process group (weak-referenceable, like the real ones)
        def size(self) -> int:
            return 4

    nccl, gloo, unregistered = Group(), Group(), Group()
    backends = {id(nccl): "nccl", id(gloo): "gloo"}

    def get_backend(group: object) -> str:
        if id(group) not in backends:
            raise ValueError("not a registered process group")
        return backends[id(group)]

    monkeypatch.setattr(torch.distributed, "get_backend", get_backend)
    states = {group: ddp_hook.state_for(group) for group in (nccl, gloo, unregistered)}
    assert states[nccl].options.reduceOp == torch.distributed.ReduceOp.AVG
    assert states[nccl].divisor == 1
    for group in (gloo, unregistered):
        assert states[group].options.reduceOp == torch.distributed.ReduceOp.SUM
        assert states[group].divisor == 4
    assert ddp_hook.state_for(nccl) is states[nccl]  # worked out once per group


def _last_state(out: Path) -> schema.RankState:
    beats = [r for r in _records(out) if isinstance(r, schema.Heartbeat)]
    return beats[-1].state


def test_shutdown_during_an_exception_marks_the_rank_failed(dirs: tuple[Path, Path]) -> None:
    _init(dirs)
    with pytest.raises(RuntimeError), contextlib.ExitStack() as stack:
        stack.callback(vigil.agent.shutdown)  # the user's `finally: shutdown()`
        with vigil.agent.step(0, tokens=1):
            pass
        raise RuntimeError("peer gone")
    assert _last_state(dirs[0]) is schema.RankState.FAILED


def test_a_clean_shutdown_marks_the_rank_finished(dirs: tuple[Path, Path]) -> None:
    _init(dirs)
    with vigil.agent.step(0, tokens=1):
        pass
    vigil.agent.shutdown()
    assert _last_state(dirs[0]) is schema.RankState.FINISHED


def test_with_a_collector_also_jsonl_keeps_a_local_copy(dirs: tuple[Path, Path]) -> None:
    # Port 9 (discard) on loopback refuses: batches go to the spool, the JSONL copy is written.
    _init(dirs, collector="http://127.0.0.1:9", also_jsonl=True)
    with vigil.agent.step(0, tokens=1):
        pass
    vigil.agent.shutdown()
    assert any(isinstance(r, schema.StepRecord) for r in _records(dirs[0]))


def test_the_local_copy_does_not_wait_for_a_collector_that_never_answers(
    dirs: tuple[Path, Path],
) -> None:
    """A collector that takes connections and never answers holds each POST for its timeout
    (5 s, retried); the JSONL copy is written before the records go to it, not after."""
    with socket.socket() as mute:  # listens (the kernel completes connections), never reads
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        url = f"http://127.0.0.1:{mute.getsockname()[1]}"
        _init(dirs, collector=url, also_jsonl=True, shutdown_timeout_s=1.0)
        with vigil.agent.step(0, tokens=1):
            pass
        path = dirs[0] / "unit" / "rank-00000.jsonl"
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and b'"type":"step"' not in path.read_bytes():
            time.sleep(0.05)
        written = any(isinstance(r, schema.StepRecord) for r in _records(dirs[0]))
        vigil.agent.shutdown()
    assert written
