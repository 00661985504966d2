"""Running coroutines from synchronous code, also where an event loop already runs (Jupyter)."""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine


def run_sync(coro: Coroutine) -> Any:
    """`asyncio.run(coro)`; inside a running loop (a notebook), on a fresh loop in a worker thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    result: dict = {}

    def target():
        try:
            result["value"] = asyncio.run(coro)
        except BaseException as e:  # re-raised in the caller's thread
            result["error"] = e

    t = threading.Thread(target=target, name="sfrrl-run-sync")
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]
    return result["value"]
