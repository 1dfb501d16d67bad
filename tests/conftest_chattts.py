"""Shared ChatTTS fixtures: a tiny random-weight checkpoint, the Chat loaded from it, an engine.

Everything runs the real ChatTTS code (tokenizer, GPT, decoder, Vocos) on a ~3 MB model that
the project builds itself in a second; nothing is downloaded and nothing is mocked.
Test modules import the fixtures they use from here (or conftest.py re-exports them).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.chattts.engine import ChatTTSEngine
from agent.chattts.loader import LoadedModel, load_chat
from agent.chattts.tiny import build_tiny_model
from agent.config import ChatTTSSettings

# Device the ChatTTS tests load the model on: "cpu" unless VOICE_AGENT_TEST_DEVICE says otherwise
# (e.g. "cuda", as bench/gpu_check.sh sets it). Tests that pass a device themselves keep theirs.
TEST_DEVICE: str = os.environ.get("VOICE_AGENT_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("chattts") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_settings(tiny_model_dir: Path) -> ChatTTSSettings:
    return ChatTTSSettings(model_dir=tiny_model_dir, device=TEST_DEVICE, threads=2)


@pytest.fixture(scope="session")
def tiny_chat(tiny_settings: ChatTTSSettings) -> LoadedModel:
    """A Chat of its own, for tests that drive the GPT and decoder directly."""
    return load_chat(tiny_settings)


@pytest.fixture(scope="session")
def chattts_engine(tiny_settings: ChatTTSSettings) -> Iterator[ChatTTSEngine]:
    """One started engine for the whole session (the product also loads once per process).

    Each test consumes it from its own event loop: streams bind to the loop that submits them.
    """
    engine = ChatTTSEngine(tiny_settings)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.close())
