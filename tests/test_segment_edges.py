"""Segmenter behaviour the other tests left unguarded (found by mutation testing)."""

from __future__ import annotations

import pytest

from agent.text.segment import Segmenter


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
