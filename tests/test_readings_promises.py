"""Promises of the readings, segmenter, NACK and room-metric changes of 2026-12-02 that hand
mutation testing found untested (89 mutations, 32 survived): each test fails with one
mutation of the product code applied (named in its comment) and passes on the code as it
is. The last three tests are readings those changes first got wrong (right before them)."""

from __future__ import annotations

import pytest

from agent.text.normalize import normalize_for_tts
from agent.text.segment import Segmenter

# --- agent/text/normalize.py --------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "lang", "expected"),
    [
        # _read_scaled: 万 read as its amount in English too (mutation: "if not zh:" read it
        # "three point five ten thousand yen")
        ("¥3.5万", "en", "thirty five thousand yen"),
        # 亿 is a hundred million, not a billion (mutation: 亿 -> "billion": 二十亿元)
        ("¥2亿", "en", "two hundred million yen"),
        ("投资¥3亿", None, "投资三亿元"),
    ],
)
def test_wan_and_yi_after_a_price_are_their_amounts(
    text: str, lang: str | None, expected: str
) -> None:
    assert normalize_for_tts(text, lang) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a number with a decimal point and a scale letter, no word after it (mutation: the
        # "frac or" dropped: "two point five B")
        ("Revenue hit 2.5B.", "Revenue hit two point five billion."),
        # a name followed by "is" (mutation: _NOT_COUNTED ignored: "fourteen billion is")
        ("14B is by the window.", "fourteen B is by the window."),
        # a race (mutation: "run"/"race" dropped: "ten thousand race")
        ("I ran a 10K race.", "I ran a ten K race."),
        # a chip (mutation: the 4-digit "k" rule dropped)
        ("the 14900K runs hot", "the fourteen thousand nine hundred K runs hot"),
        # a retirement plan (mutation: 401/403/457 dropped: "four hundred one thousand plan");
        # said "four oh one k" since tests/test_readings_domains.py
        ("my 401k plan", "my four oh one k plan"),
        # a place word capitalised as a sentence starts (mutation: no .lower())
        ("Gate 22B opens at noon.", "Gate twenty two B opens at noon."),
    ],
)
def test_scale_letters_count_only_amounts(text: str, expected: str) -> None:
    assert normalize_for_tts(text) == expected


def test_a_domain_path_ending_a_sentence_keeps_its_full_stop() -> None:
    """Mutation: _domain's stop dropped ("See github dot com Then go.", no pause)."""
    assert normalize_for_tts("See github.com/user/repo. Then go.") == "See github dot com. Then go."


def test_a_capitalised_etc_ending_a_sentence_keeps_its_full_stop() -> None:
    """Mutation: the stop only for "etc." as written (m.group(0) == "etc.")."""
    assert normalize_for_tts("Etc. Then we start.") == "et cetera. Then we start."


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a two-digit end is a year only after a dash (mutation: lookbehind dropped:
        # "twelve hundred to ninety five")
        (
            "Scores ranged 1200 to 95 points.",
            "Scores ranged one thousand two hundred to ninety five points.",
        ),
        # a price range of four-digit amounts is money, not years (mutation: _YEAR_RANGE before
        # _MONEY_RANGE)
        ("$1500-2000 per month", "one thousand five hundred to two thousand dollars per month"),
    ],
)
def test_numbers_that_are_no_year_range(text: str, expected: str) -> None:
    assert normalize_for_tts(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # mutation: the (?<![=(]) lookbehinds of _FACTOR dropped ("y equals 2 times")
        ("Let y = 2x.", "Let y equals two x."),
    ],
)
def test_an_algebra_term_after_equals_is_not_a_factor(text: str, expected: str) -> None:
    assert normalize_for_tts(text) == expected


def test_a_price_range_with_cents_at_one_end_says_the_cents() -> None:
    """Mutation: any() -> all() ("nine point nine nine to fifteen dollars")."""
    assert (
        normalize_for_tts("It costs $9.99-15.")
        == "It costs nine dollars and ninety nine cents to fifteen dollars."
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("他得了第2名", "他得了第二名"),  # mutation: the 第 check dropped (第两名)
        ("等了2.5个小时", "等了二点五个小时"),  # mutation: "not m['frac']" dropped (两个小时)
    ],
)
def test_two_is_liang_only_as_a_whole_count(text: str, expected: str) -> None:
    assert normalize_for_tts(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("in Jan 2020", "in January twenty twenty"),  # mutation: the month's name not spelled out
        ("in Sept. 2023", "in September twenty twenty three"),  # mutation: no "\.?" after it
    ],
)
def test_an_abbreviated_month_before_a_year(text: str, expected: str) -> None:
    assert normalize_for_tts(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # mutation: ".js" without its lookahead ("package J S on")
        ("Edit package.json now.", "Edit package dot jason now."),
        # mutation: the extension without its lookahead ("app dot T S x")
        ("Open app.tsx now.", "Open app dot T S X now."),
        # mutation: the acronym pair rule taking lower-case words ("true false")
        ("Return true/false.", "Return true slash false."),
        ("64 kbps", "sixty four kilobits per second"),  # mutation: kbps unit removed
        (
            "$0.002/request",
            "zero point zero zero two dollars per request",
        ),  # mutation: no "request"
    ],
)
def test_technical_names_and_units(text: str, expected: str) -> None:
    assert normalize_for_tts(text) == expected


# --- agent/text/segment.py: _continued after a forced cut --------------------------------

LONG_CLAUSE = (
    "the company that later became the largest maker of electric bicycles in the region "
    "after years of slow growth and several changes of owner and name was finally listed "
    "on the stock exchange in"
)


def _long_body() -> str:
    words = LONG_CLAUSE.split()
    body = ""
    i = 0
    while len(body) < 195:
        body += words[i % len(words)] + " "
        i += 1
    return "It " + body


def _stream(segmenter: Segmenter, text: str) -> list[str]:
    out: list[str] = []
    for ch in text:
        out += segmenter.push(ch)
    return out + segmenter.flush()


def test_a_list_item_after_the_sentence_cut_for_length_is_a_list_item_again() -> None:
    """Once the cut sentence has ended, a number opening the buffer is a list item again
    (mutation: _continued not reset when a sentence is taken: "2." said alone)."""
    out = _stream(Segmenter(), _long_body() + "2015. Its shares doubled.\n2. Next point is this.")
    assert out[1:] == ["2015.", "Its shares doubled.", "2. Next point is this."]


def test_a_segmenter_flushed_after_a_cut_reads_the_next_stream_afresh() -> None:
    """Mutation: flush() not resetting _continued: the next stream's "1." said alone."""
    segmenter = Segmenter()
    _stream(segmenter, _long_body() + "2015 and")
    assert _stream(segmenter, "1. First do this.\n2. Then that.") == [
        "1. First do this.",
        "2. Then that.",
    ]


def test_an_abbreviation_after_a_cut_does_not_end_the_sentence() -> None:
    """The continued flag only overrules the list-item rule (mutation: checked first, so
    "Dr." after a cut ended the sentence: "... with Dr." / "Smith as chair.")."""
    out = _stream(Segmenter(), _long_body() + "2015 with Dr. Smith as chair. Then more.")
    assert out[1:] == ["2015 with Dr. Smith as chair.", "Then more."]


def test_a_list_item_after_a_short_sentence_joined_to_the_cut_one() -> None:
    """With min_chars, a list item after short sentences held with the cut one's tail is a
    list item (mutation: "continued and start == 0" -> "continued": "3." said alone)."""
    out = _stream(
        Segmenter(max_chars=200, min_chars=10), _long_body() + "2015.\nOk.\n3. Next step is here."
    )
    assert not any(piece.rstrip().endswith("3.") for piece in out)


# --- signaling/ssrcguard.py: NACK trimming keeps the newest as listed ---------------------


async def test_a_trimmed_nack_across_the_sequence_wrap_keeps_the_newest_as_listed() -> None:
    """ "The last MAX_NACKED of them (the newest, as a receiver lists them)": across the
    65535 -> 0 wrap the newest are the low numbers listed last (mutation: sorted(set(lost))
    instead of dict.fromkeys: it sent 65528-65535 again, the oldest, and dropped 1-8)."""
    import struct

    from aiortc import RTCRtpSender
    from aiortc.rtcdtlstransport import RtpRouter
    from aiortc.rtp import (
        RTCP_RTPFB,
        RTCP_RTPFB_NACK,
        RTP_HISTORY_SIZE,
        RtcpPacket,
        RtpPacket,
        pack_rtcp_packet,
    )

    from signaling.ssrcguard import MAX_NACKED, _GuardedRouter

    class Transport:
        state = "connected"

        def __init__(self) -> None:
            self.sent: list[bytes] = []

        async def _send_rtp(self, data: bytes) -> None:
            self.sent.append(data)

    transport = Transport()
    sender = RTCRtpSender("audio", transport)  # type: ignore[arg-type]
    history = sender._RTCRtpSender__rtp_history  # type: ignore[attr-defined]
    for seq in [*range(65500, 65536), *range(0, 30)]:  # what it sent last, across the wrap
        history[seq % RTP_HISTORY_SIZE] = RtpPacket(
            payload_type=111, sequence_number=seq, ssrc=sender._ssrc, payload=b"\xf8" * 80
        )
    router = RtpRouter()
    router.__class__ = _GuardedRouter
    router.register_sender(sender, sender._ssrc)
    # 65528-65535 one entry each, then 0-16 (25 numbers, oldest first, as a receiver lists)
    fcis = [(pid, 0) for pid in range(65528, 65536)] + [(0, 0xFFFF)]
    payload = struct.pack("!LL", 1, sender._ssrc)
    payload += b"".join(struct.pack("!HH", pid, blp) for pid, blp in fcis)
    for parsed in RtcpPacket.parse(pack_rtcp_packet(RTCP_RTPFB, RTCP_RTPFB_NACK, payload)):
        for recipient in router.route_rtcp(parsed):
            await recipient._handle_rtcp_packet(parsed)
    sent = [RtpPacket.parse(p).sequence_number for p in transport.sent]
    assert sent == list(range(1, 17))
    assert len(sent) == MAX_NACKED


# --- agent/room.py: only the agent's speech counts as speech in a room -------------------


@pytest.mark.parametrize("direct_send", [True, False], ids=["direct", "aiortc-sender"])
async def test_a_rooms_silence_is_not_counted_as_speech(direct_send: bool) -> None:
    """The room's agent track sends silence all the time: a participant counts only the
    packets that carried speech (mutation: speech=True for every packet published: the
    speech counter grew with the silence, as fast as packets_sent)."""
    import asyncio

    import aiohttp

    from agent.config import Config, RoomSettings
    from tests.conftest import serve
    from tests.doubles import ToneEngine
    from tests.rtc_client import RtcClient
    from tests.test_metrics import scrape, value

    cfg = Config(host="127.0.0.1", port=0, rooms=RoomSettings(direct_send=direct_send))
    async with serve(cfg, ToneEngine()) as server, aiohttp.ClientSession() as http:
        client = RtcClient(server.url, http)
        try:
            await client.connect(room="m", slots=1)
            await asyncio.sleep(0.5)
            before = await scrape(http, server.url)
            await asyncio.sleep(1.0)  # nobody speaks: the agent's track sends silence
            after = await scrape(http, server.url)
        finally:
            await client.close()

    def grew(name: str) -> float:
        return value(after, name) - value(before, name)

    assert grew("voice_agent_packets_sent_total") >= 25  # silence is flowing
    assert grew("voice_agent_speech_packets_sent_total") == 0


# --- false positives of the new reading rules, fixed (they read right before them) ---------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # 次 and 元 in _TAKES_LIANG: 二次 (quadratic, squared) and 二元 (two unknowns) are
        # terms, never 两次/两元; 年级 is a grade (二年级), not a count of years.
        ("求x的2次方。", "求x的二次方。"),
        ("这是一个2次函数。", "这是一个二次函数。"),
        ("解这个2次方程。", "解这个二次方程。"),
        ("这是2元一次方程组。", "这是二元一次方程组。"),
        ("他上2年级了。", "他上二年级了。"),
    ],
)
def test_liang_is_not_said_for_a_math_term_or_a_grade(text: str, expected: str) -> None:
    assert normalize_for_tts(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # _MONEY_RANGE's "\sto\s" takes "$5 to 3 friends" for a range of prices: "five to
        # three dollars friends" (before: five dollars to three friends).
        ("Give $5 to 3 friends.", "Give five dollars to three friends."),
        (
            "She donated $100 to 20 charities.",
            "She donated one hundred dollars to twenty charities.",
        ),
    ],
)
def test_a_price_given_to_a_count_is_no_price_range(text: str, expected: str) -> None:
    assert normalize_for_tts(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # the "g" unit: a g-force and a network generation are no grams
        ("We pulled 9 g in the turn.", "We pulled nine g in the turn."),
        ("The 5g network is fast.", "The five g network is fast."),
        # _SCALED_NUMBER: a shoe width is no count ("ten million shoes")
        ("He wears size 10M shoes.", "He wears size ten M shoes."),
    ],
)
def test_a_letter_after_a_number_that_is_no_gram_or_million(text: str, expected: str) -> None:
    assert normalize_for_tts(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("rows B2-5", "rows B two to five"),  # a range, though glued to a letter
        ("The Core i7-12700 is fast.", "The Core i seven twelve thousand seven hundred is fast."),
        ("融资¥3.5万元", "融资三万五千元"),  # the text's own 元 is not said twice
        ("只要$5美元", "只要五美元"),
        ("all .txt files", "all dot text files"),  # an extension alone is a file type
    ],
)
def test_a_short_glued_range_and_a_currency_written_twice(text: str, expected: str) -> None:
    """ "B2-5" lost its "to" to the model-number rule (only a number of three digits or more
    beside the dash names a model); "¥3.5万元" was 三万五千元元."""
    assert normalize_for_tts(text) == expected
