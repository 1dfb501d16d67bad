"""Segmenter / split_text: sentences out as soon as they are complete, never too long."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.text.normalize import normalize_for_tts
from agent.text.segment import Segmenter, split_text

# (text, expected segments) with the default max_chars.
SENTENCES: list[tuple[str, list[str]]] = [
    ("Hello there. How are you? I'm fine!", ["Hello there.", "How are you?", "I'm fine!"]),
    ("Hi. OK.", ["Hi.", "OK."]),
    (
        "Mr. Smith met Dr. Who at 3:30 p.m. Then they left.",
        ["Mr. Smith met Dr. Who at 3:30 p.m.", "Then they left."],
    ),
    ("Mrs. Jones and Prof. Xavier vs. St. Louis.", ["Mrs. Jones and Prof. Xavier vs. St. Louis."]),
    ("J. K. Rowling wrote it. It sold well.", ["J. K. Rowling wrote it.", "It sold well."]),
    (
        "Buy fruit, e.g. apples, i.e. the red ones. Then go.",
        ["Buy fruit, e.g. apples, i.e. the red ones.", "Then go."],
    ),
    (
        "I live in the U.S. and like it. The U.S. Army is big.",
        ["I live in the U.S. and like it.", "The U.S. Army is big."],
    ),
    (
        "Meet at 9 a.m. tomorrow. Bring $3.50, please.",
        ["Meet at 9 a.m. tomorrow.", "Bring $3.50, please."],
    ),
    (
        "Pi is 3.14. Version 1.2.3 is out. Wait... what? Well... maybe.",
        ["Pi is 3.14.", "Version 1.2.3 is out.", "Wait... what?", "Well... maybe."],
    ),
    ("Count 1...10 slowly. Done.", ["Count 1...10 slowly.", "Done."]),
    (
        "Visit https://example.com/a?b=1&c=2. Or www.example.org. Thanks!",
        ["Visit https://example.com/a?b=1&c=2.", "Or www.example.org.", "Thanks!"],
    ),
    ("It costs $12.50! Really? Yes; it does.", ["It costs $12.50!", "Really?", "Yes;", "it does."]),
    (
        'He said "Stop." Then he left. (It was late.) Fine.',
        ['He said "Stop."', "Then he left.", "(It was late.)", "Fine."],
    ),
    (
        "Options:\n1. First option\n2. Second option\n\nPick one.",
        ["Options:", "1. First option", "2. Second option", "Pick one."],
    ),
    (
        "你好。今天天气很好！我们去公园吧？好的",
        ["你好。", "今天天气很好！", "我们去公园吧？", "好的"],
    ),
    ("他说：“走吧。”然后离开了；我留下。", ["他说：“走吧。”", "然后离开了；", "我留下。"]),
    ("Hello! 你好。How are you? 我很好！", ["Hello!", "你好。", "How are you?", "我很好！"]),
    ("I love 北京. It is great!", ["I love 北京.", "It is great!"]),
    (
        "No. I disagree. See No. 5 and Fig. 3 for details.",
        ["No.", "I disagree.", "See No. 5 and Fig. 3 for details."],
    ),
    ("   \n\n  ", []),
    ("", []),
]

# (text, max_chars, expected pieces): sentences too long for one piece.
LONG: list[tuple[str, int, list[str]]] = [
    (
        "This sentence keeps going and going, with clauses separated by commas, and more"
        " words after that, until it is far too long to speak in one piece.",
        60,
        [
            "This sentence keeps going and going,",
            "with clauses separated by commas, and more words after that,",
            "until it is far too long to speak in one piece.",
        ],
    ),
    (
        "Supercalifragilisticexpialidocious " * 3,
        40,
        [
            "Supercalifragilisticexpialidocious",
            "Supercalifragilisticexpialidocious",
            "Supercalifragilisticexpialidocious",
        ],
    ),
    (
        "这是一个非常长的中文句子，没有句号但是有逗号，我们需要在逗号处切开，这样每一段都不会太长",
        20,
        [
            "这是一个非常长的中文句子，",
            "没有句号但是有逗号，",
            "我们需要在逗号处切开，",
            "这样每一段都不会太长",
        ],
    ),
    (
        "一二三四五六七八九十一二三四五六七八九十一二三四五六七八九十一二三四五六七八九十一二三四五六七八九十",
        20,
        [
            "一二三四五六七八九十一二三四五六七八九十",
            "一二三四五六七八九十一二三四五六七八九十",
            "一二三四五六七八九十",
        ],
    ),
    (
        "word " * 30,
        50,
        [
            "word word word word word word word word word word",
            "word word word word word word word word word word",
            "word word word word word word word word word word",
        ],
    ),
    (
        "The price is $1,234.56 and the time is 12:30:45 and the site is example.com/path today",
        30,
        [
            "The price is $1,234.56 and the",
            "time is 12:30:45 and the site",
            "is example.com/path today",
        ],
    ),
    # A URL or an address is cut around, never inside (the normalizer reads a whole one as
    # its host name, a cut-off tail character by character); one too long is a piece alone.
    (
        "Read the guide at https://docs.example.com/section-1/section-2/section-3?q=1 before"
        " you start.",
        40,
        [
            "Read the guide at",
            "https://docs.example.com/section-1/section-2/section-3?q=1",
            "before you start.",
        ],
    ),
    (
        "See https://en.example.org/wiki/Mercury_(planet)?(ref) for the facts",
        50,
        ["See", "https://en.example.org/wiki/Mercury_(planet)?(ref)", "for the facts"],
    ),
    (
        "Write to a.very.long.name.for.testing@example.com today",
        20,
        ["Write to", "a.very.long.name.for.testing@example.com", "today"],
    ),
]

LLM_ANSWER = (
    "Sure! Here's the plan. First, we buy milk for $3.50 at 5 p.m. today. "
    "Then Dr. Lee calls at 6:30. The total is 3.5% higher than in the U.S. last year.\n"
    "1. Milk\n2. Bread\nThat's all."
)


def _tokens(text: str) -> list[str]:
    """LLM-style tokens: a word with its leading spaces, punctuation and newlines apart."""
    return re.findall(r"\n|[ \t]*(?:\w+|[^\w\s]+)|[ \t]+$", text)


@pytest.mark.parametrize(("text", "expected"), SENTENCES)
def test_split_text_sentences(text: str, expected: list[str]) -> None:
    assert split_text(text) == expected


@pytest.mark.parametrize(("text", "max_chars", "expected"), LONG)
def test_split_text_long(text: str, max_chars: int, expected: list[str]) -> None:
    assert split_text(text, max_chars=max_chars) == expected


def test_streamed_llm_answer_token_by_token() -> None:
    segmenter = Segmenter()
    emitted: list[tuple[str, list[str]]] = []
    for token in _tokens(LLM_ANSWER):
        out = segmenter.push(token)
        if out:
            emitted.append((token, out))
    emitted.append(("<end>", segmenter.flush()))
    # Each sentence leaves as soon as the next token proves it complete.
    assert emitted == [
        (" Here", ["Sure!"]),
        (" First", ["Here's the plan."]),
        (" Then", ["First, we buy milk for $3.50 at 5 p.m. today."]),
        (" The", ["Then Dr. Lee calls at 6:30."]),
        ("\n", ["The total is 3.5% higher than in the U.S. last year."]),
        ("\n", ["1. Milk"]),
        ("\n", ["2. Bread"]),
        ("<end>", ["That's all."]),
    ]


def test_streamed_equals_whole_text() -> None:
    segmenter = Segmenter()
    streamed = [s for t in _tokens(LLM_ANSWER) for s in segmenter.push(t)]
    assert streamed + segmenter.flush() == split_text(LLM_ANSWER)


def test_cjk_sentence_is_emitted_immediately() -> None:
    segmenter = Segmenter()
    assert segmenter.push("你好") == []
    assert segmenter.push("。") == ["你好。"]
    assert segmenter.push("今天") == []
    assert segmenter.push("很好！我们") == ["今天很好！"]
    assert segmenter.flush() == ["我们"]


def test_decimal_and_price_are_not_split_across_deltas() -> None:
    segmenter = Segmenter()
    assert segmenter.push("It costs $3.") == []
    assert segmenter.push("50 today.") == []
    assert segmenter.push(" Pi is 3.") == ["It costs $3.50 today."]
    assert segmenter.push("14") == []
    assert segmenter.flush() == ["Pi is 3.14"]


def test_abbreviation_at_delta_end_waits_for_next_word() -> None:
    segmenter = Segmenter()
    assert segmenter.push("Ask Dr.") == []
    assert segmenter.push(" ") == []
    assert segmenter.push("Lee now.") == []
    assert segmenter.flush() == ["Ask Dr. Lee now."]


def test_a_long_url_is_one_segment_streamed_or_not_and_read_as_its_host() -> None:
    url = "https://docs.example.com/" + "/".join(f"section-{i}" for i in range(30)) + "?q=1"
    text = f"Read the guide at {url} before you start."
    assert len(url) > 200
    assert split_text(text) == ["Read the guide at", url, "before you start."]
    segmenter = Segmenter()
    streamed: list[str] = []
    for ch in text:  # the URL is longer than max_chars long before it is complete
        streamed += segmenter.push(ch)
    assert streamed + segmenter.flush() == split_text(text)
    assert normalize_for_tts(url) == "docs dot example dot com"


def test_long_unterminated_text_is_emitted_early_in_clauses() -> None:
    segmenter = Segmenter(max_chars=40)
    out: list[str] = []
    for token in _tokens("We walked along the river, past the old mill, and up the hill to"):
        out += segmenter.push(token)
    # "past the old mill, and up the hill to" is 37 chars: still waiting for more.
    assert out == ["We walked along the river,"]
    assert segmenter.push(" the top") == ["past the old mill,"]
    assert segmenter.flush() == ["and up the hill to the top"]


def test_min_chars_joins_short_sentences() -> None:
    segmenter = Segmenter(min_chars=10)
    assert segmenter.push("Hi. OK. ") == []
    assert segmenter.push("This is longer. Yes") == ["Hi. OK. This is longer."]
    assert segmenter.flush() == ["Yes"]


def test_flush_resets_the_segmenter() -> None:
    segmenter = Segmenter()
    segmenter.push("One")
    assert segmenter.flush() == ["One"]
    assert segmenter.flush() == []
    assert segmenter.push("Two. Three") == ["Two."]
    assert segmenter.flush() == ["Three"]


@pytest.mark.parametrize(("max_chars", "min_chars"), [(0, 1), (10, 0), (10, 11)])
def test_bad_limits_are_rejected(max_chars: int, min_chars: int) -> None:
    with pytest.raises(ValueError):
        Segmenter(max_chars=max_chars, min_chars=min_chars)


_TRICKY = st.sampled_from(list('ab Z1.!?;,:。！？；，、\n $3.50 U.S. Mr. 你好 e.g. ...…"”@/'))
_DELTAS = st.lists(
    st.one_of(
        st.text(max_size=12),
        st.text(alphabet=_TRICKY, max_size=12),
        st.sampled_from([" https://", " www.", "example.com/", "a.b@c.d"]),
    )
)


@settings(max_examples=300, deadline=None)
@given(deltas=_DELTAS, max_chars=st.integers(1, 60))
def test_stream_invariants(deltas: list[str], max_chars: int) -> None:
    segmenter = Segmenter(max_chars=max_chars)
    out: list[str] = []
    for delta in deltas:
        out += segmenter.push(delta)
        # Memory stays bounded, but for a URL or an address still arriving (never cut).
        assert len(segmenter._buf) <= max_chars or _unbreakable(segmenter._buf)
    out += segmenter.flush()
    for segment in out:
        assert segment and segment == segment.strip()
        assert len(segment) <= max_chars or _unbreakable(segment)

    # Nothing is lost or reordered: only whitespace at the cuts and orphan closing quotes.
    def visible(text: str) -> str:
        return "".join(text.split()).translate(_DROP_ORPHANS)

    assert visible("".join(out)) == visible("".join(deltas))


def _unbreakable(text: str) -> bool:
    """Looks like one URL or e-mail address (neither holds whitespace)."""
    address = "@" in text or "://" in text or "www." in text.lower()
    return address and not any(c.isspace() for c in text)


_DROP_ORPHANS = str.maketrans("", "", "”」』）】》")
_CLOSERS = "\"')]}»”’」』）】"
_SENTENCE_POOL = [s for _, segments in SENTENCES for s in segments]


@settings(max_examples=200, deadline=None)
@given(
    sentences=st.lists(st.sampled_from(_SENTENCE_POOL), min_size=1, max_size=8),
    cuts=st.lists(st.integers(0, 2000), max_size=40),
)
def test_any_chunking_gives_the_same_segments(sentences: list[str], cuts: list[int]) -> None:
    text = " ".join(sentences)
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    segmenter = Segmenter()
    out: list[str] = []
    for a, b in itertools.pairwise(points):
        out += segmenter.push(text[a:b])
    out += segmenter.flush()
    # A closing quote after 。 may arrive after the sentence already left (latency wins);
    # the orphan quote is dropped, so compare without closers.
    assert [s.rstrip(_CLOSERS) for s in out] == [s.rstrip(_CLOSERS) for s in split_text(text)]
