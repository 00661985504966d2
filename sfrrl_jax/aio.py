"""Asyncio plumbing for running user code: from synchronous code, bounded, and contained.

`run_sync(coro)` runs a coroutine to its end from synchronous code, also where an event loop
already runs (Jupyter), and never waits at exit for tasks that ignore cancellation.

User code (tools, reward functions, environments, rollout functions) runs behind boundaries that
keep one sample's misbehaviour from ending the step or the process:

- Containment. Anything user code raises is its sample's error, `SystemExit`, `KeyboardInterrupt`
  and `GeneratorExit` included (an `argparse` on bad input, a `sys.exit()` in a reward). Only
  `asyncio.CancelledError` passes, and only when it is a cancellation of the waiting task
  (`own_cancellation()`): that is how a stop reaches coroutines. A real Ctrl-C or SIGTERM never
  arrives as an exception raised inside user code: the trainer's runner (`launch/runner.py`)
  installs handlers that only record the stop (`trainer/stop_signal.py`), and `asyncio.Runner`
  (under `run_sync`) turns SIGINT into a cancellation of the main task. So a KeyboardInterrupt
  that user code raises is that code's own doing, and catching it there stops nothing real.
  Boundaries that await user code run it as its own task (`user_task`): asyncio re-raises a
  SystemExit or KeyboardInterrupt that leaves a task out of the event loop, which would end the
  whole run; the task's wrapper holds it (and anything else) as a `Raised` value instead.
  `UserCodeExit` carries such an exception as an ordinary `Exception` where a boundary must raise.
- Abandonment. `wait_or_abandon(task, deadline)` waits for a task until a deadline, then cancels
  it and, if it has not ended within a short grace (it swallows cancellation, or cleans up
  forever), stops waiting: the task is orphaned, counted, and left to end on its own (or with
  its loop: `run_sync` does not wait for orphans at exit).
  `DaemonThreadPool` runs blocking calls on daemon threads, and a call abandoned at its timeout
  gives up its thread to a replacement (a thread cannot be killed; a process can).
"""
from __future__ import annotations

import asyncio
import inspect
import collections
import concurrent.futures
import contextvars
import logging
import threading
import weakref
from typing import Any, Callable, Coroutine

_log = logging.getLogger(__name__)

# How long a cancelled user task may take to end before it is abandoned (orphaned).
ABANDON_GRACE_S = 0.5


# ----------------------------------------------------------------------------- containment

class UserCodeExit(Exception):
    """User code raised a BaseException that is not an Exception (SystemExit, KeyboardInterrupt,
    GeneratorExit, a stray CancelledError), carried as an ordinary error of the sample that
    raised it. `original` is that exception; `str()` names its type and message."""

    def __init__(self, original: BaseException, where: str = ""):
        self.original = original
        super().__init__(describe(original) + (f" (raised by {where})" if where else ""))


def describe(e: BaseException) -> str:
    """'Type: message' ('Type' alone without a message); a `UserCodeExit` as its original."""
    if isinstance(e, UserCodeExit):
        return str(e)
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def own_cancellation() -> bool:
    """Whether the running task has a cancellation request pending: a CancelledError seen now is
    a stop of this task (re-raise it), not something user code raised or leaked."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Raised:
    """What a `user_task` raised, held as its result (never re-raised by asyncio)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error

    def __repr__(self) -> str:
        return f"Raised({self.error!r})"


async def _contained(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    try:
        return await fn(*args, **kwargs)
    except asyncio.CancelledError as e:
        if own_cancellation():
            raise  # cancelled by its waiter (wait_or_abandon): the task ends cancelled
        return Raised(e)  # raised or leaked by the user code itself
    except BaseException as e:  # see the module doc: user code's, never the run's
        return Raised(e)


def user_task(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> asyncio.Task:
    """`await fn(*args, **kwargs)` as a task of its own (a synchronous raise in the call
    included), whose result is the value or a `Raised` holding what it raised. The task ends
    cancelled only when cancelled."""
    return asyncio.ensure_future(_contained(fn, args, kwargs))


# ----------------------------------------------------------------------------- abandonment

_orphan_sink: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("sfrrl_orphan_sink", default=None)
_orphans: "weakref.WeakSet[asyncio.Future]" = weakref.WeakSet()  # tasks abandoned (run_sync's teardown)


def count_orphans() -> tuple[list[int], contextvars.Token]:
    """Starts counting the tasks and calls abandoned in this context (and the tasks it starts):
    returns (the one-item count, the token for `_orphan_sink.reset`)."""
    sink = [0]
    return sink, _orphan_sink.set(sink)


def stop_counting_orphans(token: contextvars.Token) -> None:
    """Ends the count `count_orphans` started (its token)."""
    _orphan_sink.reset(token)


def note_orphan() -> None:
    """One more abandoned task or call in the current context's count (if one is kept)."""
    sink = _orphan_sink.get()
    if sink is not None:
        sink[0] += 1


class Deadline:
    """A deadline in event-loop time that may move (None: none yet); waiters wake when it does."""

    def __init__(self, when: float | None = None):
        self.when = when
        self._moved: asyncio.Future | None = None

    def move(self, when: float | None) -> None:
        """Sets the deadline to `when` and wakes its waiters."""
        self.when = when
        if self._moved is not None and not self._moved.done():
            self._moved.set_result(None)

    def moved(self) -> asyncio.Future:
        """A future done once the deadline moves from now on."""
        if self._moved is None or self._moved.done():
            self._moved = asyncio.get_running_loop().create_future()
        return self._moved


async def wait_or_abandon(task: asyncio.Future, deadline: Deadline | float | None, *,
                          grace: float = ABANDON_GRACE_S, on_abandon: Callable[[], None] | None = None) -> bool:
    """Waits for `task` until `deadline` (event-loop time; None: no limit). True if it finished.

    Otherwise (the deadline passed: False; or this waiter was cancelled: CancelledError) the task
    is cancelled and given `grace` seconds to end; one still running then is abandoned: never
    awaited again, counted (`note_orphan`, `on_abandon`). Unlike `asyncio.timeout`, which waits
    for the cancelled task however long it takes, this never waits past deadline + grace.
    """
    if not isinstance(deadline, Deadline):
        deadline = Deadline(deadline)
    loop = asyncio.get_running_loop()
    try:
        while not task.done():
            left = None if deadline.when is None else deadline.when - loop.time()
            if left is not None and left <= 0:
                break
            await asyncio.wait((task, deadline.moved()), timeout=left, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        await _give_up(task, grace, on_abandon)
        raise
    if task.done():
        return True
    await _give_up(task, grace, on_abandon)
    return False


async def _give_up(task: asyncio.Future, grace: float, on_abandon: Callable[[], None] | None) -> None:
    task.cancel()
    try:
        await asyncio.wait((task,), timeout=grace)
    finally:  # also when this waiter is cancelled again meanwhile
        if not task.done():
            _log.warning("abandoned %r: still running %.1f s after it was cancelled", task, grace)
            _orphans.add(task)
            note_orphan()
            if on_abandon is not None:
                on_abandon()


# ----------------------------------------------------------------------------- threads

class DaemonThreadPool:
    """Blocking calls on at most `workers` daemon threads serving one queue, first in first out.

    Unlike `concurrent.futures.ThreadPoolExecutor`, whose threads the interpreter joins at exit
    (one call that never returns holds the process forever):
    - threads are daemons, never joined at exit;
    - `abandon(future)` writes off the thread running a call its caller gave up on: another
      thread takes its place, so no queued call waits behind it (at most `max_written_off`
      threads are written off at once: each pins a stack; past that, calls queue behind them);
    - nobody but its submitter cancels a queued call (`shutdown(cancel_futures=True)` aside).
    A call's exception, a SystemExit included, is set on its future.
    """

    def __init__(self, workers: int, name: str = "worker", max_written_off: int = 256):
        if workers <= 0:
            raise ValueError(f"DaemonThreadPool: workers must be > 0, got {workers}")
        self.workers, self.name, self.max_written_off = workers, name, max_written_off
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queue: collections.deque = collections.deque()
        self._serving = 0   # threads serving the queue
        self._idle = 0      # of which waiting for work
        self._running: dict[concurrent.futures.Future, threading.Thread] = {}
        self._threads: set[threading.Thread] = set()  # serving the queue
        self._written_off: set[threading.Thread] = set()
        self._shutdown = False
        self._started = 0

    @property
    def written_off(self) -> int:
        """Threads still inside a call that was abandoned."""
        with self._lock:
            return len(self._written_off)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new calls after shutdown")
            self._queue.append((future, fn, args, kwargs))
            self._grow()
            self._work.notify()
        return future

    def _grow(self) -> None:
        # under the lock: a thread for each queued call no idle thread will take, up to `workers`
        while len(self._queue) > self._idle and self._serving < self.workers:
            self._serving += 1
            self._started += 1
            thread = threading.Thread(target=self._serve, name=f"{self.name}_{self._started}", daemon=True)
            self._threads.add(thread)
            thread.start()

    def _serve(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                while not self._queue and not self._shutdown:
                    self._idle += 1
                    self._work.wait()
                    self._idle -= 1
                if not self._queue:  # shut down and drained
                    self._serving -= 1
                    self._threads.discard(me)
                    return
                future, fn, args, kwargs = self._queue.popleft()
                if not future.set_running_or_notify_cancel():
                    continue  # its submitter gave up on it while it was queued
                self._running[future] = me
            result = None
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # the caller's to read, whatever it is; the thread goes on
                future.set_exception(e)
            else:
                future.set_result(result)
            with self._lock:
                self._running.pop(future, None)
                if me in self._written_off:  # its place was taken meanwhile: leave
                    self._written_off.discard(me)
                    return
            del future, fn, args, kwargs, result  # drop references before waiting for more work

    def abandon(self, future: concurrent.futures.Future) -> bool:
        """The caller gives up on `future`: cancelled if still queued (False), else, if it is
        running, its thread is written off and replaced (True; False past `max_written_off`)."""
        if future.cancel():
            return False
        with self._lock:
            thread = self._running.pop(future, None)
            if thread is None or future.done():
                return False
            if len(self._written_off) >= self.max_written_off:
                _log.warning("%s: %d threads are stuck in abandoned calls; not replacing more",
                             self.name, len(self._written_off))
                return False
            self._written_off.add(thread)
            self._threads.discard(thread)
            self._serving -= 1
            self._grow()
        return True

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new calls; queued ones still run unless `cancel_futures`. `wait`: join the threads
        serving the queue (not those written off)."""
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while self._queue:
                    self._queue.popleft()[0].cancel()
            self._work.notify_all()
            threads = list(self._threads) if wait else []
        for t in threads:
            if t is not threading.current_thread():
                t.join()


def loop_waiter(future: concurrent.futures.Future) -> asyncio.Future:
    """An asyncio future of the running loop that completes (with None) once `future` is done;
    read the outcome from `future` itself. Unlike `asyncio.wrap_future`, a thread that finishes
    after the loop closed logs nothing, and nothing is copied (a SystemExit neither)."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake(_: concurrent.futures.Future) -> None:
        try:
            loop.call_soon_threadsafe(_set_done, waiter)
        except RuntimeError:  # the loop closed meanwhile: nobody waits any more
            pass

    future.add_done_callback(wake)
    return waiter


def _set_done(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


# ----------------------------------------------------------------------------- run_sync

def run_sync(coro: Coroutine) -> Any:
    """Runs `coro` to its end on a fresh event loop (as `asyncio.run`; inside a running loop, a
    notebook's, on a fresh loop in a worker thread) and returns its result.

    At the end, as `asyncio.run`, it cancels the tasks left and waits for them, except those
    abandoned as orphans (`wait_or_abandon`: they ignored a cancellation already), for which
    asyncio.run would wait forever: they get `ABANDON_GRACE_S` more, then are abandoned with the
    loop (logged), and the caller goes on.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass  # none runs here: run it on this thread (outside the handler, so its errors chain nothing)
    else:
        return _run_in_thread(coro)
    return _run(coro)


def _run_in_thread(coro: Coroutine) -> Any:
    result: dict = {}

    def target():
        try:
            result["value"] = _run(coro)
        except BaseException as e:  # re-raised in the caller's thread
            result["error"] = e

    t = threading.Thread(target=target, name="sfrrl-run-sync")
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _run(coro: Coroutine) -> Any:
    # asyncio.Runner, for asyncio.run's behaviour (SIGINT cancels the main task, in the main
    # thread), with a teardown of our own
    runner = asyncio.Runner()
    try:
        return runner.run(coro)
    finally:
        _close(runner)


def _close(runner: asyncio.Runner) -> None:
    loop = runner.get_loop()
    stuck: set | None = None
    try:
        stuck = runner.run(_cancel_leftovers(ABANDON_GRACE_S))
    finally:
        if stuck is not None and not stuck:
            runner.close()
        else:
            # Runner.close would wait for them (forever): close the loop around them instead.
            # Each is destroyed pending (asyncio logs it); its coroutine closes when collected.
            if stuck:
                _log.warning("abandoning %d task(s) that ignored cancellation at the end of the run: %s",
                             len(stuck), sorted(repr(t) for t in stuck)[:3])
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                asyncio.set_event_loop(None)
                loop.close()


async def _cancel_leftovers(grace: float) -> set[asyncio.Task]:
    """Cancels the loop's other tasks and waits for them as asyncio.run does, except that tasks
    abandoned as orphans (they ignored a cancellation already) get `grace` seconds: returns the
    ones still running then."""
    me = asyncio.current_task()
    left = {t for t in asyncio.all_tasks() if t is not me}
    for t in left:
        t.cancel()
    waited = {t for t in left if t not in _orphans}
    if waited:
        await asyncio.wait(waited)
    stuck = {t for t in asyncio.all_tasks() if t is not me and not t.done()}  # orphans by now
    for t in stuck:
        t.cancel()
    if stuck:
        await asyncio.wait(stuck, timeout=grace)
    loop = asyncio.get_running_loop()
    for t in left:  # as asyncio.run reports them
        if t.done() and not t.cancelled() and t.exception() is not None:
            loop.call_exception_handler({"message": "unhandled exception during run_sync() shutdown",
                                         "exception": t.exception(), "task": t})
    return {t for t in stuck if not t.done()}


async def settled(value: Any) -> Any:
    """`value`, awaited first if it is an awaitable (user code that may be sync or async: an
    episode's reset, a remote episode's user turn)."""
    return await value if inspect.isawaitable(value) else value
