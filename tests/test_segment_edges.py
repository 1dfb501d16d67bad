"""Segmenter behaviour the other tests left unguarded (found by mutation testing)."""

from __future__ import annotations

import re
import sys

import pytest

from agent.text import segment
from agent.text.segment import Segmenter, split_text


@pytest.mark.parametrize("closer", ["”", "」", "）"])
def test_a_closing_quote_after_an_emitted_cjk_sentence_is_not_spoken(closer: str) -> None:
    """A CJK sentence goes to the engine at its 。 before the closing quote has streamed
    in: the quote must not open the next piece, nor become a piece of its own."""
    segmenter = Segmenter()
    assert segmenter.push("他说：“你好。") == ["他说：“你好。"]
    assert segmenter.push(closer) == []
    assert segmenter.push("我很好。") == ["我很好。"]
    assert segmenter.push(closer) == []
    assert segmenter.flush() == []


class _CountingSearch:
    """Stands in for a compiled pattern: counts the characters its searches ran over."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern = pattern
        self.scanned = 0

    def search(self, text: str, pos: int = 0, endpos: int = sys.maxsize) -> re.Match[str] | None:
        found = self.pattern.search(text, pos, endpos)
        self.scanned += (found.end() if found else min(len(text), endpos)) - pos
        return found


@pytest.mark.parametrize(
    "text",
    [
        "https://" + "a." * 1500,  # a URL with a dot every other character
        "see " + "a. " * 1000,  # dots that end nothing ("e.g. this")
        "Dr. " * 1000,  # abbreviations
    ],
)
def test_a_stream_a_character_at_a_time_costs_linear_time(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every push rescanned the whole buffer from its start, and each dot copied the rest of
    it: a client streaming a 5000-character dotted URL one character per `text.delta` held
    the event loop for 5 s in all (1-4 ms a message). A push now goes on from where the last
    scan stopped, and a URL is held whole up to 5x max_chars (then cut like a long word)."""
    counter = _CountingSearch(segment._TERMINATOR)
    monkeypatch.setattr(segment, "_TERMINATOR", counter)
    segmenter = Segmenter(max_chars=200)
    pieces = []
    for ch in text:
        pieces += segmenter.push(ch)
        assert len(segmenter._buf) <= 5 * 200 + 1
    pieces += segmenter.flush()
    assert counter.scanned <= 4 * len(text), counter.scanned  # was ~len(text)**2 / 2
    assert "".join(pieces).replace(" ", "") == text.replace(" ", "")
    assert all(len(piece) <= 1000 for piece in pieces), max(map(len, pieces))


def test_a_long_url_is_held_whole_until_it_is_complete() -> None:
    """Up to 5x max_chars a URL still arriving is not cut (the normalizer reads a whole one
    as its host name, a cut-off tail character by character)."""
    url = "https://docs.example.com/" + "a/" * 200  # 425 characters
    segmenter = Segmenter(max_chars=200)
    pieces = [p for ch in url for p in segmenter.push(ch)]
    assert pieces == []
    assert segmenter.push(" and more.") == [url]
    assert segmenter.flush() == ["and more."]


def test_chinese_text_after_a_url_is_not_held_as_part_of_it() -> None:
    """The segmenter's URL (never cut) ran to the next space or "，。", so Chinese written
    straight after a URL, with no punctuation for a while, came out as one piece far over
    max_chars. A URL ends at its first non-ASCII character, as in the normalizer."""
    url = "https://example.com/a"
    text = f"打开{url}" + "中" * 300
    pieces = split_text(text, 200)
    assert max(len(p) for p in pieces) <= 200
    assert "".join(pieces) == text
