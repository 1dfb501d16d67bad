"""Running blocking work on a thread of our own and awaiting its result on the event loop;
how many cores there are to run threads on."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
from collections.abc import Callable
from pathlib import Path
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


CGROUP_ROOT = Path("/sys/fs/cgroup")


def cores() -> int:
    """Cores this process may use: what every "one per core" sizes itself by (--workers 0,
    --encode-threads -1, --threads 0). Affinity and cpusets, not the machine's count, and a
    cgroup CPU quota (a container given 2 CPUs of a 64-core host: 2, not 64 media
    processes that the quota would throttle together)."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity on macOS
        allowed = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is None:
        return allowed
    # Whole cores, rounded down (as Go's automaxprocs): a group over its quota is stopped
    # for the rest of the period (up to 100 ms of silence on every stream), so a share
    # of a core is not worth another process. At least one.
    return max(1, min(allowed, math.floor(quota)))


def cgroup_cpu_quota(root: Path | None = None) -> float | None:
    """CPUs the cgroup quota allows (quota / period), None without a quota. Read where a
    container sees its own group (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), as
    joblib's loky does; an unreadable or odd file counts as no quota."""
    root = CGROUP_ROOT if root is None else root
    try:
        fields = (root / "cpu.max").read_text().split()
    except OSError:
        fields = []
        for v1 in (root / "cpu", root / "cpu,cpuacct"):
            try:
                fields = [
                    (v1 / "cpu.cfs_quota_us").read_text().strip(),
                    (v1 / "cpu.cfs_period_us").read_text().strip(),
                ]
                break
            except OSError:
                continue
    if len(fields) != 2:
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])  # "max": no quota (ValueError)
    except ValueError:
        return None
    if quota <= 0 or period <= 0:  # v1 writes -1 for none
        return None
    return quota / period
