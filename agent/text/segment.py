"""Cut text into sentence-sized pieces for TTS, incrementally as an LLM streams it.

Speech starts only when the first piece is handed to the engine, so a sentence is emitted
the moment it is known to be complete: after ``. ! ? ;`` once whitespace follows (the
whitespace is what tells "3.50" or "example.com" apart from a sentence end), right after
``。！？；`` (Chinese has no spaces), and at every newline. A "." additionally waits for
the next visible character, so that "Mr. Smith", "e.g. this" and "U.S. is" stay whole.

Pieces never exceed ``max_chars``: long sentences are cut at clause marks, then between
words (anywhere between CJK characters), and only a single word longer than ``max_chars``
is cut inside. A URL or an e-mail address is never cut: the normalizer reads a whole one
as its host name ("docs dot example dot com"), a cut-off tail character by character, so
one longer than ``max_chars`` is a piece of its own. Text is raw here; normalization
happens per piece, later.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["Segmenter", "split_text"]

_ASCII_TERMINATORS: Final = ".!?;…"
_DOTS: Final = frozenset(".…")
_CJK_TERMINATORS: Final = "。！？；"
_CLOSERS: Final = "\"')]}»”’」』）】"
# A closer left at the start of the buffer belongs to a sentence already emitted (a CJK
# terminator is emitted at once, before its closing quote arrives): drop it.
_ORPHAN_CLOSERS: Final = "”」』）】》"
_CLOSER_SET: Final = frozenset(_CLOSERS)
_RUN_CHARS: Final = frozenset(_ASCII_TERMINATORS + _CJK_TERMINATORS + _CLOSERS)
_TERMINATOR: Final = re.compile(r"[.!?;…。！？；\n]")
# A clause may end after these when whitespace follows ("3:30" and "1,000" stay whole).
_ASCII_CLAUSE: Final = ",:;"
# These end a clause by themselves.
_CJK_CLAUSE: Final = "，、：；—–"
# Characters that belong to a token ("$3.50", "3元" is two tokens but "3" is one).
_TOKEN_PUNCT: Final = "$€£¥%.,:/-'+#@&°_"
# URLs and e-mail addresses, as agent/text/normalize.py reads them (its _URL and _EMAIL),
# except that an address starts where its run of address characters does: the same spans or
# wider ones, found in linear time (from every word boundary, a long run of "a.a.a..." without
# its "@" takes quadratic time). Neither holds whitespace, Unicode's included (the normalizer
# turns a no-break space into a space before it looks).
# Its tail is matched case-sensitively: ignoring case, Unicode folds "s" and "k" onto
# non-ASCII letters (U+017F, U+212A), which the tail's class excludes.
# A host that starts non-ASCII (an internationalised name) runs to its end, as there.
_URL: Final = re.compile(
    r"(?<![A-Za-z0-9_])(?i:https?://|www\.)"
    r"(?:[^\s<>\"'\x80-\U0010FFFF]+"
    r"|(?=[^\x00-\x7f])[^\s<>\"'/?#，。、；：！？（）]+(?:[/?#][^\s<>\"'\x80-\U0010FFFF]*)?)"
)
_EMAIL: Final = re.compile(
    r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+", re.ASCII
)
_WHITESPACE: Final = re.compile(r"\s")
_VISIBLE: Final = re.compile(r"\S")
# Longer than any abbreviation: how far back from a "." the word before it is looked for.
_LONGEST_WORD: Final = 32
# A streamed URL or address is held whole until it is complete, up to this many times
# ``max_chars``: beyond, it is no one's speech (a hostile stream), and is cut like a word.
_HELD_ADDRESS_FACTOR: Final = 5
# Words before a "." that do not end a sentence ("Dr. Who", "e.g. this"), lower case.
_ABBREVIATIONS: Final = frozenset(
    {
        "mr",
        "mrs",
        "ms",
        "dr",
        "prof",
        "sr",
        "jr",
        "st",
        "mt",
        "gov",
        "sen",
        "rep",
        "gen",
        "lt",
        "capt",
        "col",
        "sgt",
        "vs",
        "v",  # "Brown v. Board of Education"
        "cf",
        "approx",
        "e.g",
        "i.e",
        "u.s",
        "u.k",
        "u.n",
        "e.u",
    }
)


# An inline list's item number ("Steps: 1. Open it. 2. Tap Save."): the sentence before it
# ends before the number, not after it ("Open it. two." | "Tap Save" before).
_LIST_MARKER: Final = re.compile(r"[0-9]{1,2}[.)][ \t]+[A-Z\"“'(*]")
# What may still become one as more text streams in.
_LIST_MARKER_PREFIX: Final = re.compile(r"[0-9]{1,2}(?:[.)][ \t]*)?")
# Words before a "." that a number follows without ending anything ("Fig. 2. Then", "Oct. 3.
# Then"), lower case.
_NUMBERED_WORDS: Final = frozenset(
    {
        "no",
        "nos",
        "fig",
        "figs",
        "vol",
        "ch",
        "chap",
        "eq",
        "p",
        "pp",
        "sec",
        "art",
        "op",
        "ver",
        "v",
        "rev",
        "ref",
        "tab",
        "pt",
        "para",
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
    }
)


def _is_cjk(ch: str) -> bool:
    code = ord(ch)
    return 0x4E00 <= code <= 0x9FFF or 0x3400 <= code <= 0x4DBF or 0x3000 <= code <= 0x303F


def _in_token(ch: str) -> bool:
    """Latin letters, digits and the symbols inside "$3.50" or "a-b" form tokens."""
    return (ch.isalnum() and not _is_cjk(ch)) or ch in _TOKEN_PUNCT


def _word_before(buf: str, dot: int, start: int) -> str:
    """The word before the "." at ``dot``, read from a window (not from the sentence's
    start: every dot of a long run of "Dr. Dr. ..." would copy the whole sentence so far)."""
    head = buf[max(start, dot - _LONGEST_WORD) : dot]
    word = head.rsplit(None, 1)[-1] if head.strip() else ""
    return word.lstrip(_CLOSERS + "\"'([{“‘")


# A list after a colon starts at 1 ("Steps: 1. Open"; "Total: 12. Then" is a sentence).
_NUMBER_AFTER_COLON: Final = re.compile(r"(?<![0-9])[:：]1$")
# Initials written without spaces ("J.K", "J.R.R" before their last "."), lower case too.
_INITIALS: Final = re.compile(r"(?:[A-Z]\.)+[A-Z]")


def _is_name_or_abbreviation(word: str) -> bool:
    return (
        word.lower() in _ABBREVIATIONS
        or (len(word) == 1 and word.isupper())
        or (_INITIALS.fullmatch(word) is not None and word not in _COUNTRY_INITIALS)
    )


# Initials that name a place, not a person: a sentence may end on them ("in the U.S.A.").
_COUNTRY_INITIALS: Final = frozenset({"U.S.A", "U.A.E", "P.R.C", "U.S.S.R"})


def _dot_ends_sentence(buf: str, dot: int, start: int, after: int, continued: bool) -> bool:
    """Decide whether the "." at ``dot`` ends a sentence, given where the next visible
    character is (``after``; an inline list's number there is settled by the caller).
    ``continued``: ``buf[start:]`` continues a sentence cut for length (no list item)."""
    nxt = buf[after]
    word = _word_before(buf, dot, start)
    if nxt.isdigit():
        # "No. 5", "Fig. 3"; but "Open it. 2. Tap Save": the next item of an inline list.
        return (
            _LIST_MARKER.match(buf, after) is not None
            and not _is_name_or_abbreviation(word)
            and word.lower() not in _NUMBERED_WORDS
        )
    if nxt.islower():
        return False  # "e.g. this", "a.m. tomorrow"
    if _is_name_or_abbreviation(word):
        return False  # "Dr. Who", "the U.S. Army", an initial: "J. K. Rowling"
    # A number opening the sentence is a list item ("1. First"), not a sentence, as is one
    # after a colon ("Steps: 1. Open it"); not so a number that opens what is left of a
    # sentence cut for length ("... listed in | 2015.").
    if continued:
        return True
    if _NUMBER_AFTER_COLON.search(word):
        return False  # "步骤：1. 打开": Chinese writes no space after its colon
    if not word.isdigit():
        return True
    before = buf[max(start, dot - len(word) - _LONGEST_WORD) : dot - len(word)].rstrip()
    opens = _VISIBLE.search(buf, start, dot - len(word)) is None
    return not (opens or (word == "1" and before.endswith((":", "："))))


def _find_boundary(
    buf: str, start: int, final: bool, scan_from: int = 0, continued: bool = False
) -> tuple[int | None, int]:
    """End (exclusive) of the first complete sentence in ``buf[start:]``, or None; and where
    a later scan of ``buf`` grown at its end may start (``scan_from`` then): every terminator
    before that point is settled, the text after it ruling it out ("3.50", "e.g. this").

    None also means "not decidable yet": more text may turn a "." into "3.5".
    ``final`` says no more text will come, so an open terminator at the end counts.
    ``continued``: ``buf`` starts inside a sentence cut for length.
    """
    pos = max(start, scan_from)
    while (m := _TERMINATOR.search(buf, pos)) is not None:
        at = m.start()
        ch = buf[at]
        if ch == "\n":
            return at + 1, at + 1
        end = at + 1
        while end < len(buf) and buf[end] in _RUN_CHARS:
            end += 1
        if ch in _CJK_TERMINATORS:
            return end, end
        if end == len(buf):
            return (end, end) if final else (None, at)
        nxt = buf[end]
        if not nxt.isspace() and not _is_cjk(nxt):
            pos = end  # "3.50", "example.com", "?!" inside a URL
            continue
        if ch not in _DOTS if end == at + 1 else not set(buf[at:end]) - _CLOSER_SET <= _DOTS:
            return end, end  # ! ? ; end a sentence regardless of what follows
        # The next visible character (found, not by copying the rest of the buffer, which
        # made a text of many dots quadratic).
        visible = _VISIBLE.search(buf, end)
        rest = visible.start() if visible is not None else len(buf)
        if "\n" in buf[end:rest]:
            return end, end  # a line break ends the sentence whatever follows
        if visible is None:
            return (end, end) if final else (None, at)
        if not final and _LIST_MARKER_PREFIX.fullmatch(buf, rest) is not None:
            return None, at  # "it. 2" may be an inline list's "it. 2. Tap": wait and see
        if _dot_ends_sentence(buf, at, start, rest, continued and start == 0):
            return end, end
        pos = end
    return None, len(buf)


def _unbreakable(text: str) -> list[tuple[int, int]]:
    """(start, end) of every URL and e-mail address in ``text``, in order."""
    # Most text has neither: skip the scans (this runs for every cut of a long text).
    url = "://" in text or "www." in text.lower()
    spans = [(m.start(), m.end()) for m in _URL.finditer(text)] if url else []
    if "@" in text:
        spans += [(m.start(), m.end()) for m in _EMAIL.finditer(text)]
        spans.sort()
    return spans


def _cut_position(text: str, limit: int) -> int:
    """Where to cut ``text`` (longer than ``limit``) so the head fits in ``limit`` chars.

    Prefers the last clause mark, then the last gap between words (or next to a CJK
    character); a word longer than ``limit`` is cut inside as a last resort. Never inside a
    URL or e-mail address: one that starts the text and is longer than ``limit`` is cut
    after (the result is then beyond ``limit``, ``len(text)`` if it may still go on).
    """
    # Spans that hold a position up to ``limit`` end before the first whitespace after it.
    gap = _WHITESPACE.search(text, limit)
    window = gap.start() if gap is not None else len(text)
    spans = _unbreakable(text[:window])
    inside = [False] * (limit + 1)  # where a cut would split a URL or an address
    for start, end in spans:
        for i in range(start + 1, min(end, limit + 1)):
            inside[i] = True
    clause = word = 0
    for i in range(1, min(limit, len(text) - 1) + 1):
        if inside[i]:
            continue
        before, after = text[i - 1], text[i]
        if before in _CJK_CLAUSE or (before in _ASCII_CLAUSE and after.isspace()):
            clause = i
        if after.isspace() or not (before.isspace() or _in_token(before) or _in_token(after)):
            word = i
    if clause or word or not inside[limit]:
        return clause or word or limit
    start, end = next((s, e) for s, e in spans if s < limit < e)
    return start or end


def _split_long(text: str, limit: int) -> list[str]:
    """Split one sentence into stripped pieces of at most ``limit`` chars."""
    pieces: list[str] = []
    text = text.strip()
    while len(text) > limit:
        cut = _cut_position(text, limit)
        head = text[:cut].strip()
        if head:
            pieces.append(head)
        text = text[cut:].lstrip()
    if text:
        pieces.append(text)
    return pieces


class Segmenter:
    """Incremental sentence segmenter: ``push`` text deltas, ``flush`` at end of stream.

    ``min_chars`` holds back sentences shorter than it and joins them with what follows
    (at most ``max_chars``); the default 1 emits every sentence at once, for latency.
    """

    def __init__(self, max_chars: int = 200, min_chars: int = 1) -> None:
        if max_chars < 1:
            raise ValueError("max_chars must be at least 1")
        if not 1 <= min_chars <= max_chars:
            raise ValueError("min_chars must be between 1 and max_chars")
        self._max = max_chars
        self._min = min_chars
        self._buf = ""
        # Where the last scan of the buffer stopped: (the sentence's start, where to go on
        # scanning). A stream sent a character at a time would otherwise have the whole
        # buffer rescanned for every character: quadratic, on the event loop.
        self._scan = (0, 0)
        # The buffer starts inside a sentence that was cut for length: a number opening it
        # is that sentence's, not a list item (streamed text was cut unlike split_text).
        self._continued = False

    def push(self, delta: str) -> list[str]:
        """Add text; return the segments it completed (often none)."""
        self._buf += delta
        out = self._take_sentences(final=False)
        # No terminator in sight but already too long: speak a clause now rather than
        # waiting (and buffering) without bound.
        while len(self._buf) > self._max:
            cut = _cut_position(self._buf, self._max)
            if cut >= len(self._buf):
                if len(self._buf) <= self._max * _HELD_ADDRESS_FACTOR:
                    break  # a long URL or address still arriving: cut after it once complete
                cut = self._max  # no one's speech: cut it like a long word
            out.extend(_split_long(self._buf[:cut], self._max))
            self._set_buffer(self._buf[cut:].lstrip())
            self._continued = True
        return out

    def flush(self) -> list[str]:
        """End of stream: return whatever is left, as sentences and pieces."""
        out = self._take_sentences(final=True)
        out.extend(_split_long(self._buf, self._max))
        self._set_buffer("")
        self._continued = False
        return out

    def _set_buffer(self, text: str) -> None:
        """Replace the buffer by ``text`` (the rest of it): the next scan starts over."""
        self._buf = text
        self._scan = (0, 0)

    def _take_sentences(self, final: bool) -> list[str]:
        out: list[str] = []
        stripped = self._buf.lstrip().lstrip(_ORPHAN_CLOSERS).lstrip()
        if len(stripped) != len(self._buf):
            self._set_buffer(stripped)
        start, scan_from = self._scan
        while True:
            end, scan_from = _find_boundary(self._buf, start, final, scan_from, self._continued)
            if end is None:
                break
            if len(self._buf[:end].strip()) < self._min:
                if end < len(self._buf):
                    start = end  # too short: join it to the next sentence
                    continue
                if not final:
                    scan_from = start  # too short and nothing after it yet: wait
                    break

            out.extend(_split_long(self._buf[:end], self._max))
            self._set_buffer(self._buf[end:].lstrip().lstrip(_ORPHAN_CLOSERS).lstrip())
            self._continued = False
            start = scan_from = 0
        self._scan = (start, scan_from)
        return out


def split_text(text: str, max_chars: int = 200) -> list[str]:
    """Segment a whole text at once (same result as one ``push`` and a ``flush``)."""
    segmenter = Segmenter(max_chars=max_chars)
    return segmenter.push(text) + segmenter.flush()
