"""Tells the progress page while torch.compile compiles in this process.

A recompilation mid-run (a new input shape, a guard that failed, the backward compiled lazily at
its first use) stops a rank's step for seconds to minutes while its peers wait in the next
collective: to the hang checks that is silence, and without this it read as a hang. torch's
compile callbacks (`torch._dynamo.callback`: Dynamo's frame compiles, the lazy backward, Triton
autotuning, CUDA graph recording; nested ones count once) set and clear the page's `compiling`
flag from the thread that compiles, the training thread.

`CompileWatch.poll()` runs on the flusher's tick: the callbacks are registered once
`torch._dynamo` has been imported by someone else (`torch.compile` imports it; importing it
here would cost every process ~1 s), so a job's first compile may go unflagged (its first steps
get the start-up grace anyway), and registered again after `torch._dynamo.reset()` cleared
them. A compile runs within one step or between two, in the thread that calls the model, so the
page's step boundaries clear the flag too (`PageWriter.step_ended`): no end callback missed can
leave it set. A torch without the callbacks is left alone. Fail-open: a callback's error is
counted, never raised into the compile.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

from vigil.agent import progress

_DYNAMO = "torch._dynamo"


class CompileWatch:
    def __init__(
        self, page: progress.PageWriter, on_error: Callable[[BaseException], None]
    ) -> None:
        self._page = page
        self._on_error = on_error
        self._handler: Any = None
        self._tried = False

    @property
    def installed(self) -> bool:
        """Whether torch calls this watch's callbacks now."""
        handler = self._handler
        return handler is not None and self._started in handler.start_callbacks

    def poll(self) -> None:
        """Register the callbacks once torch._dynamo is loaded (cheap until then), and again
        when `torch._dynamo.reset()` has cleared them."""
        handler = self._handler
        if handler is None:
            if self._tried or _DYNAMO not in sys.modules:
                return
            self._tried = True
            try:
                from torch._dynamo import callback

                handler = callback.callback_handler
            except (ImportError, AttributeError):  # a torch without compile callbacks
                return
            if not hasattr(handler, "register_start_callback"):
                return
            self._handler = handler
        if self._started not in handler.start_callbacks:
            handler.register_start_callback(self._started)
            handler.register_end_callback(self._ended)

    def close(self) -> None:
        handler, self._handler = self._handler, None
        if handler is not None:
            with contextlib.suppress(ValueError):  # someone cleared torch's list meanwhile
                handler.remove_start_callback(self._started)
            with contextlib.suppress(ValueError):
                handler.remove_end_callback(self._ended)

    def _started(self, *args: Any) -> None:
        try:
            self._page.compiling(True)
        except Exception as exc:  # never into the compile
            self._on_error(exc)

    def _ended(self, *args: Any) -> None:
        try:
            self._page.compiling(False)
        except Exception as exc:
            self._on_error(exc)
