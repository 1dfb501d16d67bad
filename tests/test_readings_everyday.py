"""Everyday text the day's new readings got wrong, found by a false-positive review: 579
English and 155 Chinese ordinary assistant sentences read by 2347d0c and by the day's code,
every changed reading checked. Each case failed on the code before its fix; the comments
say how it read then ("HEAD": that code) or "old" where 2347d0c read it wrong as well."""

from __future__ import annotations

import pytest

from tests.test_readings import _read

# --- 1. a mixed number swallows the number before a fraction (7a9a990/20339aa) -----------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # HEAD: "In two thousand twenty and a third of workers went remote."
        (
            "In 2020 1/3 of workers went remote.",
            "In twenty twenty one third of workers went remote.",
        ),
        (
            "By 2030 2/3 of the population will live in cities.",
            "By twenty thirty two thirds of the population will live in cities.",
        ),
        (
            "In Q2 2024 1/5 of sales were online.",
            "In Q two twenty twenty four one fifth of sales were online.",
        ),
        # HEAD: "Out of thirty and two thirds passed the test."
        ("Out of 30 2/3 passed the test.", "Out of thirty two thirds passed the test."),
    ],
)
def test_a_year_or_count_before_a_fraction_is_no_mixed_number(text: str, expected: str) -> None:
    assert _read(text) == expected


# --- 2. a fraction before a unit doubles or misspells its article (20339aa) --------------


@pytest.mark.parametrize(
    "text",
    [
        # HEAD: "A a quarter of a watt resistor" (README's own example)
        "A 1/4W resistor is fine here.",
        "It's a 1/4 mi loop around the park.",  # HEAD: "Its a a quarter of a mile loop"
    ],
)
def test_a_fraction_after_an_article_says_no_second_article(text: str) -> None:
    assert " a a " not in f" {_read(text).lower()} "


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Use 1/8 tsp of salt.", "Use an eighth of a teaspoon of salt."),  # HEAD: "a eighth"
        (
            "Add 1 1/8 cups of water.",
            "Add one and an eighth cups of water.",
        ),  # HEAD: "and a eighth"
    ],
)
def test_an_eighth_takes_an(text: str, expected: str) -> None:
    assert _read(text) == expected


# --- 3. scientific notation (20339aa) leaves the unit after it unread ---------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # 2347d0c: "... five e seven meters." (lost the minus); HEAD: "five e minus seven m."
        (
            "Green light has a wavelength of 5e-7 m.",
            "Green light has a wavelength of five e minus seven meters.",
        ),
        ("The Sun's mass is about 2e30 kg.", "The Suns mass is about two e thirty kilograms."),
        (
            "The speed of light is 3e8 m/s.",
            "The speed of light is three e eight meters per second.",
        ),
        ("Set the timeout to 5e3 ms.", "Set the timeout to five e three milliseconds."),
    ],
)
def test_a_unit_after_scientific_notation_is_read(text: str, expected: str) -> None:
    assert _read(text) == expected


# --- 4. a glued W (7a9a990) is watts after an apartment, a room, a suite, a longitude ------


@pytest.mark.parametrize(
    "text",
    [
        "My apartment is 4W, on the fourth floor.",  # HEAD: "four watts"; 2347d0c: "four W"
        "Her office is in Suite 200W of the Chrysler Building.",
        "Room 3W is at the end of the hall.",
        # HEAD: "one hundred twenty two point four watts"
        "San Francisco sits at about 37.8N, 122.4W.",
    ],
)
def test_a_unit_letter_w_after_a_place_is_no_watt(text: str) -> None:
    assert "watt" not in _read(text)


# --- 5. "for" before a decade makes it seconds (22deea2) -------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # HEAD: "perfect for ninety seconds kids."; 2347d0c: "nineties kids"
        ("This playlist is perfect for 90s kids.", "This playlist is perfect for nineties kids."),
        (
            "A lot of nostalgic shows are made for 80s fans.",
            "A lot of nostalgic shows are made for eighties fans.",
        ),
        ("She's known for 70s disco.", "Shes known for seventies disco."),
        (
            "This blog is for 20s and 30s professionals.",
            "This blog is for twenties and thirties professionals.",
        ),
    ],
)
def test_a_decade_after_for_before_a_noun_stays_a_decade(text: str, expected: str) -> None:
    assert _read(text) == expected


# --- 6. "100s"/"1000s" without "of" (0dd55a9) are seconds --------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Temperatures were in the 100s all week.",  # HEAD: "in the one hundred seconds"
        "Prices are in the 1000s for a good sofa.",  # HEAD: "in the one thousand seconds"
        "Round to the nearest 100s place.",
        "The 1000s place is 5.",
    ],
)
def test_hundreds_without_of_are_no_seconds(text: str) -> None:
    assert "second" not in _read(text)


# --- 7. an address-port guard (20339aa) loses a decimal ratio's "to" ------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # 2347d0c: "two. thirty nine to one"; HEAD: "two point three nine, one"
        (
            "The aspect ratio is 2.39:1 for most blockbusters.",
            "The aspect ratio is two point three nine to one for most blockbusters.",
        ),
        (
            "Mix concrete at a 1.5:1 ratio of sand to cement.",
            "Mix concrete at a one point five to one ratio of sand to cement.",
        ),
    ],
)
def test_a_decimal_ratio_says_to(text: str, expected: str) -> None:
    assert _read(text) == expected


# --- 8. a single digit before "images" (7a9a990): 4K images are a resolution -------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # HEAD: "four thousand images"; 2347d0c: "four K images"
        (
            "Download free 4K images for your wallpaper.",
            "Download free four K images for your wallpaper.",
        ),
        ("The camera takes 8K images.", "The camera takes eight K images."),
    ],
)
def test_4k_images_are_no_four_thousand(text: str, expected: str) -> None:
    assert _read(text) == expected


# --- 9. "n - 1" (20339aa) reads a list label's dash as a minus --------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # HEAD: "Part a minus three points, part b minus seven points."
        (
            "Part a - 3 points, part b - 7 points.",
            "Part a, three points, part b, seven points.",
        ),
        ("Option a - 5 dollars a month.", "Option a, five dollars a month."),
    ],
)
def test_a_lettered_label_before_a_dash_is_no_variable(text: str, expected: str) -> None:
    assert _read(text) == expected


# --- 10. the dotted-name rule (7a9a990) says "dot" in prose --------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Some fruits, e.g, apples, are sweet.",  # HEAD: "e dot g"; 2347d0c: "e. g"
        "Use a verb, i.e, an action word.",  # HEAD: "i dot e"
        "He said it was fine.so we left.",  # HEAD: "fine dot so we left"
    ],
)
def test_no_dot_is_said_in_prose(text: str) -> None:
    assert " dot " not in _read(text)


# --- 11. Chinese calendar years read as counts of years (20339aa/0dd55a9) -----------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # 多家/多个/多地/多次 is "many", not 多年; HEAD: 两千零二十三年多家银行...
        ("2023年多家银行下调了存款利率。", "二零二三年多家银行下调了存款利率。"),
        ("2021年多个城市实行了限行。", "二零二一年多个城市实行了限行。"),
        ("2019年多地出现极端高温。", "二零一九年多地出现极端高温。"),
        # 历史最高, 历史性: no 的历史
        ("2023年历史最高气温出现在7月。", "二零二三年历史最高气温出现在七月。"),
        ("1949年历史性的时刻，新中国成立了。", "一九四九年历史性的时刻，新中国成立了。"),
        # 约/大约 before a date
        ("他约1990年出生在上海。", "他约一九九零年出生在上海。"),
        ("这座桥大约1900年建成。", "这座桥大约一九零零年建成。"),
        # years before 1800 are still dates: 以后/以前/左右/前后 after them
        ("1644年以后，清朝统治了中国近300年。", "一六四四年以后，清朝统治了中国近三百年。"),
        ("在1644年以前，北京是明朝的都城。", "在一六四四年以前，北京是明朝的都城。"),
        ("公元1500年左右，欧洲进入了大航海时代。", "公元一五零零年左右，欧洲进入了大航海时代。"),
        ("该事件发生在1600年前后。", "该事件发生在一六零零年前后。"),
    ],
)
def test_a_chinese_calendar_year_is_no_count(text: str, expected: str) -> None:
    assert _read(text, "") == expected


# --- 12. Chinese decades read as seconds (20339aa) ------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("我最喜欢90s经典老歌。", "我最喜欢九十年代经典老歌。"),  # HEAD: 九十秒经典老歌
        ("这是一首80s老歌。", "这是一首八十年代老歌。"),
        (
            "她特别喜欢70s、80s的摇滚乐。",
            "她特别喜欢七十年代、八十年代的摇滚乐。",
        ),  # HEAD: 七十秒、八十年代
    ],
)
def test_a_chinese_decade_before_a_song_is_no_seconds(text: str, expected: str) -> None:
    assert _read(text, "") == expected


# --- old: wrong in 2347d0c too ---------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # "June tenth minus twelve"
        ("The conference runs from June 10-12.", "The conference runs from June tenth to twelfth."),
        ("The sale runs May 3-5.", "The sale runs May third to fifth."),
    ],
)
def test_old_dates(text: str, expected: str) -> None:
    assert _read(text) == expected


@pytest.mark.parametrize(
    ("text", "unwanted"),
    [
        ("打开设置 > 隐私 > 定位服务。", "大于"),  # a Chinese menu path is a comparison
        ("电费是0.56元/度。", "斜杠"),  # 每度
    ],
)
def test_old_misreadings(text: str, unwanted: str) -> None:
    assert unwanted not in _read(text, "" if "。" in text else " ")


# --- a fourth review: a new corpus of support, finance, fitness, travel and medicine text --


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # HEAD: "every ninety seconds kid", "after ninety seconds grunge"
        ("This is a song every 90s kid knows.", "This is a song every nineties kid knows."),
        ("Grunge faded after 90s excess.", "Grunge faded after nineties excess."),
        # old: "thirties", "nineties ... sixties", "forty five s"
        ("Hold each stretch for 30s.", "Hold each stretch for thirty seconds."),
        ("Jog for 90s, walk for 60s.", "Jog for ninety seconds, walk for sixty seconds."),
        ("Set the timer for 45s.", "Set the timer for forty five seconds."),
        (
            "This blog is for 20s and 30s professionals.",
            "This blog is for twenties and thirties professionals.",
        ),
        # old: "two h thirty meters"
        ("The layover is 2h 30m.", "The layover is two hours thirty minutes."),
        ("Your layover is 1h55m.", "Your layover is one hour fifty five minutes."),
        # HEAD: "Lieutenant Blue"; a name after it is still a title
        ("It comes in Navy, Lt. Blue and White.", "It comes in Navy, Light Blue and White."),
        ("Lt. Dan was there.", "Lieutenant Dan was there."),
        # HEAD: "RX hundreds"
        ("The RX100s are great cameras.", "The RX one hundred s are great cameras."),
        # old: "twenty five billion", "thirty g", "ten minutes walk"
        ("Take exit 25B toward the airport.", "Take exit twenty five B toward the airport."),
        ("Aim for 25-30 g per day.", "Aim for twenty five to thirty grams per day."),
        ("Gate C7 is a 10 min walk away.", "Gate C seven is a ten minute walk away."),
    ],
)
def test_durations_colours_models_and_measures_before_a_noun(text: str, expected: str) -> None:
    assert _read(text) == expected


def test_two_rooms_in_chinese_is_liang() -> None:
    # old: 三室二厅
    assert _read("这套房子3室2厅。") == "这套房子三室两厅。"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # old: "three fifteenths", "seven twelfths", "two slash twenty eight"
        ("It is scheduled for 3/15.", "It is scheduled for March fifteenth."),
        ("Pickup on 7/12 at noon.", "Pickup on July twelfth at noon."),
        ("The fee was waived on 2/28.", "The fee was waived on February twenty eighth."),
        # fractions stay fractions: before "of", and after "by" or "from"
        ("It ran on 3/4 of the days.", "It ran on three quarters of the days."),
        ("Cut it by 1/3.", "Cut it by one third."),
    ],
)
def test_a_month_and_day_after_a_word_that_dates_them_is_a_date(text: str, expected: str) -> None:
    assert _read(text) == expected
