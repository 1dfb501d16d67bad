"""Speech-to-text through an OpenAI-compatible ``POST {base}/audio/transcriptions``.

The utterance goes as a multipart upload of a 16 kHz mono 16-bit WAV (what whisper-style
servers resample to anyway), with ``model`` and ``response_format=json``; the answer's
``text`` is the transcript. Works with OpenAI, faster-whisper-server / speaches,
whisper.cpp's server, vLLM and others that follow the same API.
"""

from __future__ import annotations

import asyncio
import io
import json
import wave

import aiohttp
import numpy as np
import numpy.typing as npt

from agent.conversation_config import VAD_SAMPLE_RATE, ServiceSettings
from agent.httpservice import (
    ServiceError,
    auth_headers,
    decode_text,
    describe_failure,
    endpoint,
    env_proxy,
    read_capped,
)

# A transcript's JSON is a few KiB (even a verbose_json one with segments is far below
# this): whatever is larger is no transcript, and is not buffered to find that out.
MAX_ANSWER = 1 << 20


def wav_bytes(audio: npt.NDArray[np.float32], rate: int = VAD_SAMPLE_RATE) -> bytes:
    """Mono float samples in [-1, 1] as a 16-bit PCM WAV file."""
    pcm = (np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(pcm.tobytes())
    return out.getvalue()


class Transcriber:
    def __init__(self, settings: ServiceSettings, http: aiohttp.ClientSession) -> None:
        if not settings.stt_base_url:
            raise ValueError("no speech-to-text base URL")
        self._url = endpoint(settings.stt_base_url, "/audio/transcriptions")
        self._settings = settings
        self._http = http

    async def transcribe(self, audio: npt.NDArray[np.float32]) -> str:
        s = self._settings
        form = aiohttp.FormData()
        form.add_field("file", wav_bytes(audio), filename="speech.wav", content_type="audio/wav")
        form.add_field("model", s.stt_model)
        form.add_field("response_format", "json")
        if s.stt_language:
            form.add_field("language", s.stt_language)
        try:
            async with asyncio.timeout(s.stt_timeout_s) as deadline:
                async with self._http.post(
                    self._url,
                    data=form,
                    headers=auth_headers(s.stt_api_key),
                    proxy=env_proxy(self._url),
                ) as response:
                    if response.status != 200:
                        # The error body gets what is left of the time, under its own bound:
                        # one that stalls is still this failure, not a timeout.
                        loop = asyncio.get_running_loop()
                        left = max(0.0, (deadline.when() or loop.time()) - loop.time())
                        deadline.reschedule(None)
                        raise ServiceError(
                            "stt_failed",
                            "speech-to-text failed: " + await describe_failure(response, left),
                        )
                    answer, more = await read_capped(response, MAX_ANSWER)
                    if more:
                        raise ServiceError(
                            "stt_failed",
                            f"speech-to-text answered with more than {MAX_ANSWER / 2**20:g} MiB",
                        )
                    # In its declared charset (json.loads on bytes knows only UTF-8/16/32).
                    answer_text = decode_text(answer, response.charset)
        except TimeoutError:
            raise ServiceError(
                "stt_timeout", f"speech-to-text did not answer within {s.stt_timeout_s:g} s"
            ) from None
        except aiohttp.ClientError as exc:
            raise ServiceError("stt_failed", f"speech-to-text unreachable: {exc}") from None
        # Only the answer's parse: a ValueError from building the request (aiohttp refusing a
        # header) blamed a service that was never asked (found by review).
        try:
            body = json.loads(answer_text)
        except (ValueError, RecursionError):  # RecursionError: JSON nested too deep
            raise ServiceError("stt_failed", "speech-to-text answered with invalid JSON") from None
        text = body.get("text") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise ServiceError("stt_failed", "speech-to-text answer has no 'text'")
        return text.strip()
