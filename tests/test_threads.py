"""agent/threads.py: a thread job always settles the future its awaiter waits on."""

from __future__ import annotations

import asyncio
import threading

import pytest

from agent.threads import job_settling


async def _settled_by_thread(fn: object) -> asyncio.Future[object]:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[object] = loop.create_future()
    threading.Thread(target=job_settling(loop, future, fn), daemon=True).start()  # type: ignore[arg-type]
    async with asyncio.timeout(5):  # an unsettled future fails here instead of hanging
        await asyncio.wait([future])
    return future


async def test_a_result_and_an_error_reach_the_awaiter() -> None:
    assert (await _settled_by_thread(lambda: 42)).result() == 42

    def broken() -> object:
        raise ValueError("no model here")

    with pytest.raises(ValueError, match="no model here"):
        (await _settled_by_thread(broken)).result()


async def test_a_job_raising_stopiteration_still_settles_its_future() -> None:
    """asyncio refuses StopIteration into a future (TypeError in the loop's callback): the
    future stayed unsettled and an engine's start awaiting it hung with /readyz "loading"
    for good (found by review). It arrives as a RuntimeError caused by it."""

    def exhausted() -> object:
        return next(iter(()))

    future = await _settled_by_thread(exhausted)
    with pytest.raises(RuntimeError, match="StopIteration") as caught:
        future.result()
    assert isinstance(caught.value.__cause__, StopIteration)
