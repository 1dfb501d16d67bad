"""Running blocking work on a thread of our own and awaiting its result on the event loop;
how many cores there are to run threads on."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def job_settling(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[T], fn: Callable[[], T]
) -> Callable[[], None]:
    """A job for another thread: it runs ``fn`` there and settles ``future`` on ``loop``.

    A waiter that was cancelled (shutdown) or a loop that is gone is not an error: nobody
    is waiting any more.
    """

    def deliver(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if isinstance(error, StopIteration):
            # asyncio refuses StopIteration into a future (TypeError in this callback): the
            # future would never settle and its awaiter (an engine's start) hang for good.
            failure = RuntimeError(f"{type(error).__name__} raised in a thread job")
            failure.__cause__ = error
            future.set_exception(failure)
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def job() -> None:
        try:
            result, error = fn(), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is gone
            loop.call_soon_threadsafe(deliver, result, error)

    return job


def cores() -> int:
    """Cores this process may run on (affinity and cpusets, not the machine's count): what
    every "one per core" sizes itself by (--workers 0, --encode-threads -1, --threads 0)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity on macOS
        return os.cpu_count() or 1
