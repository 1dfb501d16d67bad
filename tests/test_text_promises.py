"""Promises of the text path into speech that hand mutation testing found unguarded
(review area ``mut_text``): each test here failed with one small change to the product code
and passes on the code as it is."""

from __future__ import annotations

import json

import pytest

from agent.config import Config
from agent.protocol import ProtocolError, Say, parse_message
from agent.session import AgentSession
from agent.text.segment import Segmenter, split_text
from tests.doubles import ToneEngine


def _session() -> tuple[AgentSession, list[dict[str, object]]]:
    """A session whose events are collected, driven by handle_message (no peer)."""
    session = AgentSession("s", ToneEngine(seconds_per_word=0.01), Config())
    events: list[dict[str, object]] = []
    session.outbox.send = events.append  # type: ignore[method-assign, assignment]
    return session, events


def _errors(events: list[dict[str, object]]) -> list[tuple[object, object]]:
    return [(e["code"], e.get("id")) for e in events if e["type"] == "error"]


# --- agent/text/segment.py ----------------------------------------------------------------


def test_a_sentence_end_before_chinese_text_is_released_at_once() -> None:
    """Chinese has no spaces: "Great!" followed by "你好" ends there, as it would before a
    space; the English sentence is not held back (and glued) until the Chinese one ends."""
    assert split_text("Great!你好。I agree.我也是。") == [
        "Great!",
        "你好。",
        "I agree.",
        "我也是。",
    ]
    segmenter = Segmenter()
    assert segmenter.push("Great!") == []
    assert segmenter.push("你好") == ["Great!"]
    assert segmenter.flush() == ["你好"]


def test_a_url_right_after_a_word_is_cut_before_not_inside_or_after() -> None:
    """A URL that starts mid-piece with no gap before it ("Docs:https://...") is a piece of
    its own: the cut goes before it, never inside it (not even after its first character),
    nor after it (a piece past ``max_chars`` that is not the URL alone)."""
    assert split_text("abc/https://example.com/x", max_chars=5) == [
        "abc/",
        "https://example.com/x",
    ]
    assert split_text("Docs:https://example.com/very/long/path", max_chars=10) == [
        "Docs:",
        "https://example.com/very/long/path",
    ]


def test_a_www_address_in_capitals_is_never_cut() -> None:
    """``WWW.EXAMPLE.COM/...`` is a URL to the normalizer (it ignores case): cut inside, its
    tail was read letter by letter."""
    pieces = split_text("Visit WWW.EXAMPLE.COM/docs/getting-started today", max_chars=20)
    assert "WWW.EXAMPLE.COM/docs/getting-started" in pieces, pieces
    assert all(p.count("WWW") <= 1 for p in pieces)


def test_a_streamed_sentence_of_exactly_max_chars_is_not_cut() -> None:
    """Pieces are cut only past ``max_chars``: a streamed sentence of exactly that length
    waits for its end and is spoken whole."""
    segmenter = Segmenter(max_chars=20)
    sentence = "aaaa bbbb cccc dddd."
    assert len(sentence) == 20
    assert segmenter.push(sentence) == []
    assert segmenter.push(" Next") == [sentence]
    assert segmenter.flush() == ["Next"]


def test_a_sentence_end_after_a_cut_is_found_at_once() -> None:
    """A stream cut for length (no terminator in 20 chars) still releases its next sentence
    the moment it ends: the scan starts over on the shortened buffer, rather than from where
    the longer one stopped (past the new sentence's end, which then waited for the flush)."""
    segmenter = Segmenter(max_chars=20)
    assert segmenter.push("aaaa bbbb cccc dddd eeee ffff") == ["aaaa bbbb cccc dddd"]
    assert segmenter.push(". Next one") == ["eeee ffff."]
    assert segmenter.flush() == ["Next one"]


def test_a_question_mark_after_an_ellipsis_ends_the_sentence() -> None:
    """The marks "! ? ;" end a sentence whatever follows, also after a run of dots:
    "Wait...?" is not read as an abbreviation's dot waiting for a capital letter."""
    assert split_text("Wait...? maybe not.") == ["Wait...?", "maybe not."]
    assert split_text("It was…! really.") == ["It was…!", "really."]


def test_a_closing_quote_after_a_line_break_is_no_part_of_the_next_caption() -> None:
    """A closing quote left at the start of the next sentence belongs to the one already
    emitted: it is dropped, not captioned at the head of the next one, also when several
    sentences are cut in one go."""
    assert split_text("Hello\n\u201dMore text. Next.") == ["Hello", "More text.", "Next."]
    assert split_text("他说：“好。\n》然后。走了。") == ["他说：“好。", "然后。", "走了。"]


# --- agent/protocol.py --------------------------------------------------------------------


def test_a_message_of_exactly_the_size_limit_is_accepted() -> None:
    """``too_large`` is "over 16 KiB": a message of exactly the limit is read."""
    head, tail = '{"type": "say", "text": "', '"}'
    raw = head + "a" * (16_384 - len(head) - len(tail)) + tail
    assert len(raw.encode()) == 16_384
    assert parse_message(raw, 16_384) == Say("a" * (16_384 - len(head) - len(tail)), None)
    with pytest.raises(ProtocolError) as info:
        parse_message(raw[:-2] + 'a"}', 16_384)
    assert info.value.code == "too_large"


@pytest.mark.parametrize("kind", ["say", "chat"])
def test_an_empty_id_is_bad_message(kind: str) -> None:
    """An id is a string of 1-64 characters: "" is refused, 64 characters are taken."""
    with pytest.raises(ProtocolError) as info:
        parse_message(json.dumps({"type": kind, "text": "hi", "id": ""}), 65_536)
    assert info.value.code == "bad_message"
    assert parse_message(json.dumps({"type": kind, "text": "hi", "id": "x" * 64}), 65_536)


def test_a_delta_with_a_malformed_id_refuses_the_rest_of_its_stream() -> None:
    """A refused delta, a malformed one included (here: its id is 65 characters), refuses
    the rest of its stream: the next delta gets ``stream_refused`` rather than joining what
    came before the hole ("Hello there, | world.")."""
    session, events = _session()
    for message in (
        {"type": "text.delta", "delta": "Hello there, "},
        {"type": "text.delta", "delta": "my ", "id": "x" * 65},
        {"type": "text.delta", "delta": "world."},
        {"type": "text.end"},
    ):
        session.handle_message(json.dumps(message))
    session.pipeline.discard()
    assert [code for code, _ in _errors(events)] == ["bad_message", "stream_refused"], events


def test_a_seed_voice_is_below_two_to_the_63() -> None:
    """``seed:N`` takes 0 <= N < 2^63 (a signed 64-bit seed): 2^63 itself is ``bad_config``."""
    top = parse_message(json.dumps({"type": "config", "voice": f"seed:{2**63 - 1}"}), 65_536)
    assert top.fields == {"voice": f"seed:{2**63 - 1}"}  # type: ignore[union-attr]
    with pytest.raises(ProtocolError) as info:
        parse_message(json.dumps({"type": "config", "voice": f"seed:{2**63}"}), 65_536)
    assert info.value.code == "bad_config"


def test_a_voice_string_past_4096_characters_is_bad_config() -> None:
    """A speaker string is ~1.4 kB: one past MAX_VOICE_CHARS (4096) is refused as the
    message's fault (``bad_config``), not handed to the engine's decoder."""
    ok = parse_message(json.dumps({"type": "config", "voice": "a" * 4096}), 65_536)
    assert ok.fields == {"voice": "a" * 4096}  # type: ignore[union-attr]
    with pytest.raises(ProtocolError) as info:
        parse_message(json.dumps({"type": "config", "voice": "a" * 4097}), 65_536)
    assert info.value.code == "bad_config"


def test_config_null_puts_a_field_back_to_its_default() -> None:
    """``null`` puts a field other than ``barge_in`` back to its default: the session's
    voice options lose the value set before."""
    session, events = _session()
    session.handle_message(json.dumps({"type": "config", "speed": 5, "top_k": 20}))
    assert (session.pipeline.voice.speed, session.pipeline.voice.top_k) == (5, 20)
    session.handle_message(json.dumps({"type": "config", "speed": None}))
    session.pipeline.discard()
    assert (session.pipeline.voice.speed, session.pipeline.voice.top_k) == (None, 20)
    assert _errors(events) == []


@pytest.mark.parametrize(
    "fields",
    [{"speed": True}, {"top_k": False}, {"speed": 2.5}, {"top_k": 10.5}, {"temperature": True}],
)
def test_config_numbers_are_numbers_and_integers_where_integers_are_due(
    fields: dict[str, object],
) -> None:
    """``speed`` and ``top_k`` are integers; a JSON boolean is no number (Python's True
    == 1 would pass for speed 1)."""
    with pytest.raises(ProtocolError) as info:
        parse_message(json.dumps({"type": "config", **fields}), 65_536)
    assert info.value.code == "bad_config"
    whole = parse_message(json.dumps({"type": "config", "speed": 3.0, "top_k": 7}), 65_536)
    assert whole.fields == {"speed": 3, "top_k": 7}  # type: ignore[union-attr]
    assert type(whole.fields["speed"]) is int  # type: ignore[union-attr]


class _OpenChannel:
    """A data channel already open when the outbox is attached to it (aiortc's names)."""

    readyState = "open"
    bufferedAmount = 0

    def __init__(self) -> None:
        self.sent: list[dict[str, object]] = []
        self.handlers: dict[str, object] = {}

    def on(self, name: str, handler: object) -> None:
        self.handlers[name] = handler

    def send(self, data: str) -> None:
        self.sent.append(json.loads(data))


def test_events_waiting_are_sent_when_the_channel_is_open_already_on_attach() -> None:
    """A channel that opened before the session took it never fires ``open`` again: the
    events raised meanwhile go out at once, not never."""
    from agent.outbox import EventOutbox

    outbox = EventOutbox(expects_channel=True, owner="test")
    outbox.send({"type": "a"})
    outbox.send_first({"type": "first"})
    channel = _OpenChannel()
    outbox.attach(channel, lambda _raw: None)  # type: ignore[arg-type]
    assert [e["type"] for e in channel.sent] == ["first", "a"]


def test_config_ranges_include_their_ends() -> None:
    """Ranges: ``speed`` 0-9, ``temperature`` 0.01-2.0, ``top_p`` 0.01-1.0, ``top_k``
    1-100: both ends are taken."""
    for low in ({"speed": 0}, {"temperature": 0.01}, {"top_p": 0.01}, {"top_k": 1}):
        assert parse_message(json.dumps({"type": "config", **low}), 65_536).fields == low  # type: ignore[union-attr]
    for high in ({"speed": 9}, {"temperature": 2.0}, {"top_p": 1.0}, {"top_k": 100}):
        assert parse_message(json.dumps({"type": "config", **high}), 65_536).fields == high  # type: ignore[union-attr]


# --- agent/speech.py ----------------------------------------------------------------------


async def test_a_delta_with_a_new_id_after_an_interrupt_starts_a_new_stream() -> None:
    """The rest of an interrupted stream is discarded "up to its text.end (or a delta with a
    new id)": a client that starts its next answer without ending the cut one (its
    text.end lost, or never sent) is heard, not silently dropped up to some text.end."""
    import asyncio

    from agent.config import SpeechSettings
    from agent.speech import SpeechPipeline

    events: list[dict[str, object]] = []
    pipeline = SpeechPipeline(ToneEngine(), SpeechSettings(), events.append)
    pipeline.start()
    assert pipeline.text_delta("The old answer. It", "s1") == "s1"
    pipeline.interrupt()
    assert pipeline.text_delta(" goes on. ", "s1") is None  # the old one: discarded
    assert pipeline.text_delta("A new answer. ", "s2") == "s2"
    assert pipeline.text_delta("Its rest.") == "s2"  # id-less deltas continue it
    assert pipeline.text_end() == "s2"
    await asyncio.sleep(0)
    await pipeline.close()
