"""One training process's SDK session: step boundaries, phases, collectives, MFU, control.

The training thread only reads clocks, adds numbers and keeps each ended step as raw numbers;
the flusher thread (`background.py`) builds their records, sends heartbeats once per interval
and dumps the collective ring buffer and thread stacks when the process itself suspects a hang,
and writes them out (JSONL or the collector).
Control requests (from the node agent, through the progress page, or `request_control`) run
their callbacks at the next step boundary, in the training thread.

Must not raise into training: every entry point here is wrapped fail-open by `vigil.agent.sdk`.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import faulthandler
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vigil import schema
from vigil.agent import (
    background,
    collectives,
    compiling,
    config,
    cpuwait,
    ddp_hook,
    mfu,
    patching,
    phases,
    progress,
    rankfiles,
    rundir,
    sinks,
    terminate,
)

log = logging.getLogger(__name__)

SPAN_STATES = {"data": schema.RankState.DATA, "checkpoint": schema.RankState.CHECKPOINTING}
# `span("pipeline")` marks a pipeline schedule the SDK does not wrap itself (a schedule of the
# user's own, Megatron's): its time counts as a torch.distributed.pipelining schedule's does
# (`StepRecord.pipeline_s`, with the CPU and collective waits inside).
PIPELINE_SPAN = "pipeline"
_NUMBER = (float, int)  # a plain loss value (a tuple: `float | int` builds a union per call)
# A step's CPU wait (cpuwait.py) is read at its start and end, but where the next step begins
# within this many seconds of the last one's end (the usual loop: nothing between the two but
# the loop itself), the end's reading serves as the next start's: one read of /proc per step,
# not two (each costs the training thread ~15 us there, its caches cold), and the step's wait
# then also counts at most this gap's.
CPU_WAIT_GAP_S = 0.0005
_NO_SPANS: dict[str, float] = {}  # an ended step without spans (read only)


class StepHandle:
    """What `with vigil.agent.step(i) as s:` yields: set the loss, read the step number."""

    __slots__ = ("loss", "step", "tokens")

    def __init__(self, step: int, tokens: int) -> None:
        self.step = step
        self.tokens = tokens
        self.loss: Any = None

    def set_loss(self, loss: Any) -> None:
        """A float, or a scalar tensor (read by the background thread, never synced here)."""
        self.loss = loss.detach() if isinstance(loss, torch.Tensor) else loss


class StepScope:
    """`with vigil.agent.step(i) as s:`: a plain context manager, not a generator (the step
    boundary is the SDK's hottest path in the training thread). Fail-open: its own errors are
    counted, the step's exceptions pass through, and the step is recorded either way."""

    __slots__ = ("_open", "_session", "handle")

    def __init__(self, session: Session | None, handle: StepHandle) -> None:
        self._session = session
        self.handle = handle
        self._open = False

    def __enter__(self) -> StepHandle:
        session = self._session
        if session is not None:
            try:
                self._open = session.begin_step(self.handle)
            except Exception as exc:
                session.count_error(exc)
        return self.handle

    def __exit__(self, *exc_info: object) -> None:
        if self._open:
            self._open = False
            session = self._session
            assert session is not None
            try:
                session.end_step(self.handle)
            except Exception as exc:
                session.count_error(exc)


class Session:
    """Created by `vigil.agent.init`; owns the page, the recorder, the queue and the flusher."""

    def __init__(self, cfg: config.SdkConfig, *, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self._clock = clock
        self._wall_offset = time.time() - clock()
        self.internal_errors = 0
        self._lock = threading.Lock()
        self.run_id = cfg.run_id or rundir.run_id(
            os.environ, world_size=cfg.world_size, pid=os.getpid(), pgid=os.getpgid(0)
        )
        # This run's own folder: its ranks on this node share it, other runs never do.
        self.run_dir = rundir.run_path(cfg.progress_dir, cfg.job, self.run_id)
        # The page, and its lock: held for the process's life, from before the page is
        # visible (the agent's liveness signal); let go at a clean end (`rankfiles.release`).
        self.page, self._lock_fd = rankfiles.open_page(cfg, self.run_dir, self.run_id)
        self.queue = sinks.RecordQueue(cfg.max_queued_records)
        self.recorder = collectives.CollectiveRecorder(
            page=self.page,
            on_error=self.count_error,
            clock=clock,
            wall_offset_s=self._wall_offset,
        )
        self._cpu_wait = cpuwait.ThreadCpuWait()
        self.phases = phases.PhaseTimer(
            on_error=self.count_error,
            clock=clock,
            cpu_wait=self._cpu_wait.read,
            comm_blocked=self._blocked_so_far,
        )
        self.current_step = -1
        self._in_step = False
        self._step_start = 0.0
        self._cpu_wait_start = 0.0
        self._step_end = -math.inf  # the last step's end (this clock)
        self._spans: dict[str, float] = collections.defaultdict(float)
        # On CUDA, per "data" span since the last step's end: launch and end events on the
        # training stream (background.data_time: the part of the span the device was idle).
        self._data_events: list[tuple[Any, Any, int]] = []
        self._callbacks: dict[str, list[Callable[[], Any]]] = collections.defaultdict(list)
        self._requests: collections.deque[str] = collections.deque()
        self._control_seq = 0
        self._cuda_device: int | None = None  # the training thread's, once it has one
        # A torch built without CUDA never has one: its steps skip the check.
        self._cuda_built = torch.backends.cuda.is_built()  # type: ignore[no-untyped-call]
        # Ended steps, as raw numbers: the flusher builds their records (and reads a tensor
        # loss, which may sync a device) off the training thread. Bounded like the queue.
        self._ended: collections.deque[background.EndedStep] = collections.deque(
            maxlen=cfg.max_queued_records
        )
        self.dropped_steps = 0
        self._flop_mode: Any = None
        self.device_kind, self.peak_flops = self._resolve_peak()
        self.flops_per_token = self._resolve_flops()
        self._count_flops_next = cfg.measure_flops and self.flops_per_token is None
        self._stacks_file = rankfiles.open_stacks_file(cfg, self.run_dir)
        sink, self.shipper = rankfiles.make_sink(cfg, self.run_dir)
        self.background = background.Background(
            cfg=cfg,
            queue=self.queue,
            recorder=self.recorder,
            page_path=self.page.path,
            ended=self._ended,
            clock=clock,
            wall_offset_s=self._wall_offset,
            flops_per_token=lambda: self.flops_per_token,
            cuda_device=lambda: self._cuda_device,
            write_health=self._write_health,
            dump_evidence=lambda reason: self.dump_evidence(reason=reason),
        )
        self._compiles = compiling.CompileWatch(self.page, self.count_error)
        self.flusher = sinks.Flusher(
            queue=self.queue,
            sink=sink,
            interval_s=cfg.flush_interval_s,
            tick=self._tick,
            on_error=self.count_error,
            name=f"vigil-{cfg.rank_tag}",
        )
        for record in rankfiles.identity(
            cfg,
            device_uuid=background.device_uuid(),
            device_kind=self.device_kind,
            peak_flops=self.peak_flops,
        ):
            self.queue.put(record)
        if cfg.time_collectives:
            patching.install(self.recorder)
        self._publish(schema.RankState.STARTING)
        self.flusher.start()
        # A process that exits without shutdown() (an exception ended it) says so: its peers'
        # ranks end FAILED too, while a rank killed outright (SIGKILL, os._exit, the OOM
        # killer) sends nothing more, which is how the analyzer names a crash's culprit.
        atexit.register(self._at_exit)
        self._stopping, self._stopped = threading.Lock(), False
        self._shut = threading.Event()  # set once a shutdown has shipped the last word
        self._signalled = threading.Event()  # SIGTERM came, and vigil's handler acts on it
        self._interrupted = threading.Event()  # SIGINT came (Ctrl-C): the rank is being stopped
        self._sigterm = (
            terminate.install(self._terminated, self._interrupted.set)
            if cfg.last_word_on_sigterm
            else None
        )

    # -- set-up and errors ------------------------------------------------------------------
    def _resolve_peak(self) -> tuple[str, float]:
        kind, measured = mfu.device_peak(
            measure_cpu=self.cfg.measure_cpu_peak and self.cfg.peak_flops is None
        )
        return kind, self.cfg.peak_flops or measured

    def _resolve_flops(self) -> float | None:
        if self.cfg.flops_per_token:
            return self.cfg.flops_per_token
        if self.cfg.model_shape is not None:
            return mfu.palm_flops_per_token(self.cfg.model_shape)
        return None

    def _tick(self) -> None:
        """The flusher's tick: compile callbacks once torch.compile is in use, then the
        background work (records, heartbeats, the hang suspicion)."""
        self._compiles.poll()
        self.background.tick()

    def count_error(self, exc: BaseException) -> None:
        self.internal_errors += 1
        if self.internal_errors <= 10:
            log.warning("vigil SDK internal error (training continues): %r", exc)

    def _publish(
        self, state: schema.RankState, *, step: int | None = None, checkpoint_done: bool = False
    ) -> None:
        now = self._clock()
        self.page.progress(
            state,
            now_mono=now,
            now_wall=now + self._wall_offset,
            step=step,
            checkpoint_done=checkpoint_done,
        )

    # -- the training loop API ------------------------------------------------------------
    def watch(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.phases.watch(model, optimizer)
        register = getattr(model, "register_comm_hook", None)
        if register is not None and self.cfg.time_collectives:  # DDP: reach its C++ all-reduce
            if ddp_hook.registered(model):  # an earlier session's watch: it times for this one
                return
            try:
                state = ddp_hook.state_for(getattr(model, "process_group", None))
                register(state, ddp_hook.ddp_comm_hook)
            except RuntimeError as exc:  # the user registered their own hook already
                log.warning("DDP already has a comm hook; its all-reduces are not timed: %s", exc)

    def begin_step(self, handle: StepHandle) -> bool:
        """Open a step; False for a nested one (the outer step is the boundary)."""
        if self._in_step:
            return False
        self._in_step = True
        step = handle.step
        self.current_step = step
        self.recorder.step = max(step, 0)
        self.phases.reset()
        if self._count_flops_next:  # once: measure the model's FLOPs per token
            self._count_flops_next = False
            from torch.utils.flop_counter import FlopCounterMode

            self._flop_mode = FlopCounterMode(display=False)
            self._flop_mode.__enter__()
        now = self._clock()
        if now - self._step_end > CPU_WAIT_GAP_S:  # else the last step's end reading serves
            self._cpu_wait_start = self._cpu_wait.read()
        self._step_start = now
        self.page.step_begun(step, now, now + self._wall_offset)
        return True

    def end_step(self, handle: StepHandle) -> None:
        """Close the step: page and hang history now, the records later (flusher thread)."""
        end = self._clock()
        cpu_wait = self._cpu_wait.read()
        cpu_wait_s = max(0.0, cpu_wait - self._cpu_wait_start)
        self._cpu_wait_start, self._step_end = cpu_wait, end
        self._in_step = False
        if self._flop_mode is not None:
            self._learn_flops(handle.tokens)
        sums = self.phases.take(end)  # before the recorder's swap (see take)
        aggs, blocked_s, collective_s = self.recorder.swap()
        start = self._step_start
        seconds = end - start
        tokens = handle.tokens
        util = mfu.mfu(
            flops_per_token=self.flops_per_token or 0.0,
            tokens=tokens,
            seconds=seconds,
            peak_flops=self.peak_flops,
        )
        # Spans since the previous step's end count for this step: a "data" span before
        # `with step(...)` (the usual `for batch in loader` loop) is this step's data time.
        spans = self._spans
        if spans:
            self._spans = collections.defaultdict(float)
        else:  # not the live dict: the next step's spans must not land in this step's record
            spans = _NO_SPANS
        data_events: tuple[tuple[Any, Any, int], ...] = ()
        if self._data_events:
            data_events, self._data_events = tuple(self._data_events), []
        loss = handle.loss
        ended = self._ended
        if len(ended) == ended.maxlen:
            self.dropped_steps += 1
        ended.append(
            background.EndedStep(
                handle.step, start, end, tokens, loss, sums, blocked_s, aggs, spans, util,
                cpu_wait_s, data_events,
            )
        )  # fmt: skip
        looking = self._cuda_device is None and self._cuda_built
        if looking and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            self._cuda_device = torch.cuda.current_device()  # this thread's device, once
        wall = end + self._wall_offset
        self.page.step_ended(
            handle.step,
            seconds,
            util,
            blocked_s,
            collective_s,
            end,
            wall,
            tokens,
            float(loss) if isinstance(loss, _NUMBER) else math.nan,
        )
        if self._requests or self.page.control_seq() != self._control_seq:
            self._run_control()

    def _blocked_so_far(self) -> float:
        return self.recorder.blocked_s

    def _learn_flops(self, tokens: int) -> None:
        counter, self._flop_mode = self._flop_mode, None
        counter.__exit__(None, None, None)
        total = float(counter.get_total_flops())
        if tokens > 0 and total > 0:
            self.flops_per_token = total / tokens
            log.info("measured %.3g model FLOPs per token", self.flops_per_token)

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        start = self._clock()
        state = SPAN_STATES.get(name)
        if state is not None:
            self._publish(state)
        device = self._cuda_device if name == "data" else None
        entry = self._stream_event(device) if device is not None else None
        pipeline = name == PIPELINE_SPAN
        if pipeline:  # a schedule of the user's own (or Megatron's): timed as pipelining's are
            self.phases.enter_pipeline()
        try:
            yield
        finally:
            if pipeline:
                self.phases.leave_pipeline()
            self._spans[name] += self._clock() - start
            if entry is not None and device is not None:
                leave = self._stream_event(device)
                if leave is not None:
                    self._data_events.append((entry, leave, device))
            if state is not None:
                done = state is schema.RankState.CHECKPOINTING
                self._publish(schema.RankState.COMPUTE, checkpoint_done=done)

    def _stream_event(self, device: int) -> Any:
        """A timing event on `device`'s current stream; None after an error (counted)."""
        try:
            return collectives.stream_event(device)
        except Exception as exc:  # fail-open: the span keeps its host time
            self.count_error(exc)
            return None

    # -- control --------------------------------------------------------------------------
    def on_control(self, kind: str, callback: Callable[[], Any]) -> None:
        self._callbacks[kind].append(callback)

    def request_control(self, kind: str) -> None:
        """Ask for `kind` at the next step boundary (thread-safe; also used by the page poll)."""
        self._requests.append(kind)

    def _run_control(self) -> None:
        seq, kind = self.page.control()
        if seq != self._control_seq:
            self._control_seq = seq
            self.page.ack(seq)
            if kind:
                self._requests.append(kind)
        while self._requests:
            kind = self._requests.popleft()
            log.info("control request %r at step %d", kind, self.current_step)
            if kind == "dump_stacks":
                self.dump_evidence(reason="dump_stacks requested")
            for callback in self._callbacks.get(kind, []):
                try:
                    callback()
                except Exception as exc:
                    self.count_error(exc)

    def dump_evidence(self, *, reason: str) -> None:
        """Write all thread stacks and queue the ring buffer's events (hang or request)."""
        if self._stacks_file is not None:
            self._stacks_file.write(f"# vigil: {reason} at {time.time():.3f}\n")
            self._stacks_file.flush()
            faulthandler.dump_traceback(file=self._stacks_file, all_threads=True)
        self.recorder.publish()  # the ring's overlapped ops too
        reader = progress.PageReader(self.page.path)
        try:
            self.queue.extend(reader.events())
        finally:
            reader.close()
        self.flusher.flush_soon()

    def _write_health(self) -> None:
        stats = self.shipper.stats if self.shipper else None
        dropped = self.queue.dropped + self.dropped_steps
        dropped += self.shipper.spool.dropped_records if self.shipper else 0
        self.page.health(
            progress.Health(
                internal_errors=self.internal_errors,
                dropped_records=dropped,
                ship_errors=stats.ship_errors if stats else 0,
                queued_records=len(self.queue),
                quarantined_batches=stats.quarantined_batches if stats else 0,
            )
        )

    # -- end ------------------------------------------------------------------------------
    def _at_exit(self) -> None:
        try:
            if not self.shutdown(state=self._exit_state(schema.RankState.FINISHED)):
                # SIGTERM's thread is saying the last word: the interpreter must not finish
                # exiting under it (its daemon threads stop there).
                self._shut.wait(self.cfg.shutdown_timeout_s + 1.0)
        except Exception:  # at exit nothing may raise
            log.debug("vigil SDK: shutdown at exit failed", exc_info=True)
        if self._signalled.is_set():
            # The process ends by SIGTERM (exit status -15), as the signal's thread ends it once
            # the word is out, not by the exit that was under way: whichever thread comes first.
            terminate.die(terminate.SIGNAL)

    def _exit_state(self, otherwise: schema.RankState) -> schema.RankState:
        """The last word once an unhandled exception has ended the main thread (Python sets
        `sys.last_value` before it prints the traceback: `last_word`), else `otherwise`."""
        return self.last_word(getattr(sys, "last_value", None), otherwise)

    def last_word(
        self,
        error: BaseException | None,
        otherwise: schema.RankState = schema.RankState.FINISHED,
    ) -> schema.RankState:
        """The rank's last word when `error` ends it (None, or SystemExit with status 0:
        `otherwise`): TERMINATED for Ctrl-C (KeyboardInterrupt) and for any error once SIGINT
        came (a rank blocked in a collective raises only when peers the interrupt ended break
        it: a job stopped with Ctrl-C is no crash), else FAILED."""
        if error is None or (isinstance(error, SystemExit) and error.code in (None, 0)):
            return otherwise
        if isinstance(error, KeyboardInterrupt) or self._interrupted.is_set():
            return schema.RankState.TERMINATED
        return schema.RankState.FAILED

    def _terminated(self, signum: int) -> None:
        """SIGTERM arrived (`terminate.py`, on its own thread; the process ends after this):
        the rank's last word, `terminated`, and what it holds, shipped. The training thread's
        hooks and patches stay: it may be running them. A shutdown already under way (an
        exception's, at exit: a torchrun survivor whose collective broke as the signal came)
        says its own last word first: waited for, within its timeout. One that comes once an
        exception has ended the main thread, before its exit's shutdown began, says `failed`
        for it: the rank failed first (its collective broke), the signal only came after."""
        self._signalled.set()
        state = self._exit_state(schema.RankState.TERMINATED)
        if not self.shutdown(state=state, from_signal=True):
            self._shut.wait(self.cfg.shutdown_timeout_s + 1.0)

    def shutdown(
        self, state: schema.RankState = schema.RankState.FINISHED, *, from_signal: bool = False
    ) -> bool:
        """Flush and stop; `state` is the rank's last word (FAILED when an exception ended the
        process before the training loop called shutdown, TERMINATED at SIGTERM). Waits for
        the collector at most `shutdown_timeout_s` in all; what it did not take stays spooled
        for the node agent. False: a shutdown was already under way (it says the last word)."""
        with self._stopping:
            if self._stopped:
                return False  # once: the training loop's shutdown and SIGTERM's may cross
            self._stopped = True
        try:
            self._shutdown(state, from_signal=from_signal)
        finally:
            self._shut.set()
        return True

    def _shutdown(self, state: schema.RankState, *, from_signal: bool) -> None:
        deadline = time.monotonic() + self.cfg.shutdown_timeout_s
        if self.shipper is not None:
            self.shipper.finish_by(deadline)
        if not from_signal:  # at SIGTERM, an exit under way waits for this word (_at_exit)
            atexit.unregister(self._at_exit)
            if self.cfg.time_collectives:
                patching.uninstall()
            self.phases.remove()
        self._publish(state)
        self.background.settle(final=True)
        cfg = self.cfg
        self.queue.put(
            schema.Heartbeat(
                job_id=cfg.job,
                rank=cfg.rank,
                time_s=self._clock() + self._wall_offset,  # the step records' clock
                last_step=self.current_step,
                state=state,
                checkpoints=self.page.checkpoints,
            )
        )
        self.flusher.stop(timeout_s=max(0.0, deadline - time.monotonic()))
        self._write_health()  # the final drain may have spooled (and dropped) more
        if not from_signal and self._sigterm is not None:
            # Only now that the word is written: a SIGTERM until here (torchrun stopping a
            # survivor whose collective broke) waits for it, where SIGTERM's default would end
            # the rank without one while the flusher finished a slow collector's POST.
            self._sigterm.uninstall()
        if self._stacks_file is not None:
            with contextlib.suppress(Exception):
                faulthandler.unregister(self.cfg.stack_signal)
            self._stacks_file.close()
        self.background.close()
        self._cpu_wait.close()
        self._compiles.close()
        self.page.close()
        if state is schema.RankState.FINISHED:
            lock_fd, self._lock_fd = self._lock_fd, None
            rankfiles.release(self.cfg, self.run_dir, self.page.path, lock_fd)
