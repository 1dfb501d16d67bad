"""The front's routing decisions (no processes started: the pool only decides)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import Config
from signaling.workers import WorkerPool


def pool(tmp_path: Path, workers: int = 3) -> WorkerPool:
    return WorkerPool(Config(workers=workers), lambda config: None, tmp_path)  # type: ignore[arg-type,return-value]


@pytest.mark.parametrize(
    "session_id", ["nope", "w-1", "w\u00b2-x", "w9-x", "w" + "1" * 40 + "-x", "x1-abc"]
)
def test_ids_that_name_no_worker(tmp_path: Path, session_id: str) -> None:
    assert pool(tmp_path).for_session(session_id) is None


def test_ids_name_their_worker(tmp_path: Path) -> None:
    p = pool(tmp_path)
    assert p.for_session("w2-" + "a" * 32) is p.workers[2]


def test_socket_paths_too_long_for_unix_sockets_are_refused(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120)
    with pytest.raises(ValueError, match="TMPDIR"):
        pool(deep)
