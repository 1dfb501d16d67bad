"""English readings a listener would call wrong, found by reading realistic assistant answers
(recipes, specs, code, sports, lists) through the segmenter and the normalizer: each case
failed on the code before it was fixed; the "was" comments say how it read then."""

from __future__ import annotations

import pytest

from agent.text.segment import Segmenter, split_text
from tests.test_readings import _read


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # was: "Steps, one." | "Open the app. two." | "Tap Settings. three." | ...
        (
            "Steps: 1. Open the app. 2. Tap Settings. 3. Choose Privacy.",
            ["Steps: 1. Open the app.", "2. Tap Settings.", "3. Choose Privacy."],
        ),
        (
            "Here are 3 tips: 1. Sleep. 2. Eat well.",
            ["Here are 3 tips: 1. Sleep.", "2. Eat well."],
        ),
        ("1) First item. 2) Second item.", ["1) First item.", "2) Second item."]),
    ],
)
def test_an_inline_lists_number_starts_its_item(text: str, expected: list[str]) -> None:
    assert split_text(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "See Fig. 2. Then go on.",
        "It was Oct. 3. Then we left.",
        "The room is No. 5. Next one.",
        "We met J. 2. Done.",
    ],
)
def test_a_number_after_an_abbreviation_is_not_a_list_item(text: str) -> None:
    # The dot before the number is the abbreviation's: the number stays with its word.
    word = text.split(". ", 1)[0]
    assert split_text(text)[0].startswith(word + ". ")


@pytest.mark.parametrize(
    "text",
    [
        "Steps: 1. Open the app. 2. Tap Settings. 3. Choose Privacy.",
        "See Fig. 2. Then go on. It was Oct. 3. Then we left.",
        "Costs rose. 25 people came. Open it. 10. Done.",
    ],
)
def test_a_streamed_inline_list_is_cut_as_the_whole_text_is(text: str) -> None:
    # "it. 2" is undecided until "2. T" arrives: one character at a time must agree.
    segmenter = Segmenter()
    pieces = [p for ch in text for p in segmenter.push(ch)] + segmenter.flush()
    assert pieces == split_text(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # was: "one thousand nine hundred twenty times one thousand eighty", "two times four"
        (
            "The screen is 1920x1080 and the board is 2x4 inches.",
            "The screen is one thousand nine hundred twenty by one thousand eighty and the "
            "board is two by four inches.",
        ),
        ("A 3x3 grid.", "A three by three grid."),
        # was: "twenty feet x fifteen feet"
        ("The yard is 20 ft x 15 ft.", "The yard is twenty feet by fifteen feet."),
        # arithmetic stays a product
        (
            "3x4 = 12, and 3x4 is 12.",
            "three times four equals twelve, and three times four is twelve.",
        ),
        ("What is 3x4?", "What is three times four."),
    ],
)
def test_a_size_is_by_and_a_product_is_times(text: str, expected: str) -> None:
    assert _read(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # was: "seven hundred twenty p", "one thousand eighty p", "sixty fps"
        (
            "Stream at 720p or 1080p at 60fps.",
            "Stream at seven twenty P or ten eighty P at sixty frames per second.",
        ),
        # was: "eighty three point four five s"
        ("The lap took 83.45s.", "The lap took eighty three point four five seconds."),
        # was: "one hundred s of people", "one thousands of files"
        (
            "There were 100s of people and 1000s of files in the 1990s.",
            "There were hundreds of people and thousands of files in the nineteen nineties.",
        ),
        # was: "three mi", "two tsp", "one tbsp", "sq ft"
        (
            "It is 3 mi away; add 2 tsp salt and 1 tbsp oil to 1,200 sq ft.",
            "It is three miles away. add two teaspoons salt and one tablespoon oil to one "
            "thousand two hundred square feet.",
        ),
        # was: "twelve V", "one hundred W"; spaced "W" is west
        (
            "Use a 12V adapter and a 100W bulb near I-90 W.",
            "Use a twelve volt adapter and a one hundred watt bulb near I ninety W.",
        ),
        ("A 5000mAh battery.", "A five thousand milliamp hour battery."),
    ],
)
def test_units_resolutions_seconds_and_round_plurals(text: str, expected: str) -> None:
    assert _read(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # was: "os. path", "json. loads", "torch. nn. Module"
        (
            "Import os.path, call json.loads and torch.nn.Module or Math.max.",
            "Import os dot path, call json dot loads and torch dot nn dot Module or Math dot max.",
        ),
        ("He lives in St.Louis.", "He lives in St. Louis."),
        ("It is 8 a.m. now; e.g. this.", "It is eight A M now. for example this."),
    ],
)
def test_a_dotted_name_in_code_is_said_with_dot(text: str, expected: str) -> None:
    assert _read(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # was: "Fig. two", "p. seven", "pp. ten to fifteen", "Vol. two, Ch. five, Eq. three"
        (
            "See Fig. 2 on p. 7 and pp. 10-15.",
            "See figure two on page seven and pages ten to fifteen.",
        ),
        ("See Vol. 2, Ch. 5 and Eq. 3.", "See volume two, chapter five and equation three."),
        # was: "seven B parameters"; a single digit before another word stays a name
        (
            "A 7B parameter model has 8M users.",
            "A seven billion parameter model has eight million users.",
        ),
        ("A 3M tape and a 4K screen.", "A three M tape and a four K screen."),
        # was: "sixty slash forty", "twenty slash twenty", "nine slash eleven"
        (
            "The 80/20 rule, a 60/40 split, 20/20 vision and 9/11.",
            "The eighty twenty rule, a sixty forty split, twenty twenty vision and nine eleven.",
        ),
        # was: "nine hundred eleven", "nine hundred eighty eight"
        (
            "Call 911 or text 988, then call 100 people.",
            "Call nine one one or text nine eight eight, then call one hundred people.",
        ),
        ("A 911 call.", "A nine one one call."),
    ],
)
def test_abbreviations_scales_splits_and_service_numbers(text: str, expected: str) -> None:
    assert _read(text) == expected


def test_chinese_reads_the_new_forms_in_chinese() -> None:
    assert (
        _read("视频是1080p，每秒60fps，用时3.5s。")
        == "视频是一零八零P，每秒六十帧每秒，用时三点五秒。"
    )
    assert _read("调用os.path模块，遵循80/20法则。") == "调用os点path模块，遵循八十比二十法则。"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # was: "Wait tens and retry", "every thirties", "timeout equals twenties"
        (
            "Wait 10s and retry every 30s, timeout=20s.",
            "Wait ten seconds and retry every thirty seconds, timeout equals twenty seconds.",
        ),
        # decades stay decades
        (
            "In their 30s, they loved 80s music.",
            "In their thirties, they loved eighties music.",
        ),
    ],
)
def test_a_duration_in_seconds_is_no_decade(text: str, expected: str) -> None:
    assert _read(text) == expected


def test_a_glued_t_is_a_trillion_only_before_what_it_counts() -> None:
    # "T" is tonnes or teslas as often ("a 20T truck", "a 1.5T MRI"): said as written.
    assert _read("A 20T truck and a 1.5T MRI.") == "A twenty T truck and a one point five T MRI."
    assert _read("It saw 15T tokens.") == "It saw fifteen trillion tokens."
