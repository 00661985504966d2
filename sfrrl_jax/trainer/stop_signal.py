"""SIGTERM -> save-then-exit at the next step boundary, from the main thread.

    stop = install_sigterm_handler(lambda signum: (ckpt.maybe_save(step, state, host, force=True),
                                                   ckpt.close(), sys.exit(128 + signum)))
    for step in ...:
        state = train_step(state)
        if stop.stop_if_requested():   # runs the callback once, here, if SIGTERM arrived
            break

Python runs signal handlers in the main thread, between two bytecodes of whatever it was doing --
possibly between a jitted step that donated the state's buffers and the assignment of its outputs.
So the handler itself only records the request; the save-then-exit callback runs where the loop
asks for it (`stop_if_requested`), at a step boundary where the state is whole. A second signal
while the first is pending restores the previous handler and re-sends itself: a stuck run still dies.

Multi-host: each process gets its own signal; the loop must agree to stop on all processes at the
same step before saving, since the save is collective (`launch.runner` all-gathers the signal each step).
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Callable


class StopRequest:
    """Records a stop signal; `should_stop()` is the flag the training loop polls each step."""

    def __init__(self, callback: Callable[[int], None] | None = None):
        self.callback = callback
        self.signum: int | None = None
        self._callback_ran = False
        self._previous: dict[int, object] = {}

    def should_stop(self) -> bool:
        return self.signum is not None

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Asks for a stop as if `signum` had arrived (e.g. a wall-clock budget ran out)."""
        if self.signum is None:
            self.signum = int(signum)

    def stop_if_requested(self) -> bool:
        """True if a stop was requested; the first time, runs the callback here (caller's thread)."""
        if self.signum is None:
            return False
        if not self._callback_ran:
            self._callback_ran = True
            if self.callback is not None:
                self.callback(self.signum)
        return True

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # second signal: give up on the graceful path
            self.uninstall()
            os.kill(os.getpid(), signum)
            return
        self.signum = int(signum)

    def uninstall(self) -> None:
        """Restores the handlers that were installed before."""
        global _ACTIVE
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
        if _ACTIVE is self:
            _ACTIVE = None


_ACTIVE: StopRequest | None = None


def install_sigterm_handler(callback: Callable[[int], None] | None = None,
                            signals: tuple[int, ...] = (signal.SIGTERM,)) -> StopRequest:
    """Installs a handler for `signals` that records a stop; returns the `StopRequest`.

    callback(signum): the save-then-exit path, run once by `StopRequest.stop_if_requested()`
    from the training loop, never inside the signal handler. Must be called from the main thread
    (Python only delivers signals there). Replaces an earlier `install_sigterm_handler`.
    """
    global _ACTIVE
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("install_sigterm_handler must be called from the main thread "
                           f"(called from {threading.current_thread().name!r})")
    if _ACTIVE is not None:
        _ACTIVE.uninstall()
    stop = StopRequest(callback)
    for signum in signals:
        stop._previous[signum] = signal.signal(signum, stop._handle)
    _ACTIVE = stop
    return stop


def should_stop() -> bool:
    """Whether the handler installed by `install_sigterm_handler` has received a signal."""
    return _ACTIVE is not None and _ACTIVE.should_stop()
