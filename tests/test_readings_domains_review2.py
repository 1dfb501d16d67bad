"""Found by a second review of the b3b7d0e and ca54702 readings, compared with 8460843.

Each test states what a listener would hear and what a person would say instead.
"""

from __future__ import annotations

import pytest

from agent.text.normalize import normalize_for_tts
from agent.text.segment import split_text


def read(text: str) -> str:
    return " | ".join(normalize_for_tts(p) for p in split_text(text))


# --- regressions (read right, or at least not wrongly, at 8460843) -------------------------


@pytest.mark.parametrize(
    ("text", "letter"),
    [
        ("X型腿和O型腿都可以通过锻炼改善。", "X"),  # knock-knees: was X型腿, now 十型腿
        ("她穿了一件V型领口的毛衣。", "V"),  # V-neck: now 五型领口
        ("股价走出了V型反转。", "V"),  # V-shaped rebound: now 五型反转
        ("这款V型发动机动力很强。", "V"),  # V engine: now 五型发动机
    ],
)
def test_zh_letter_shapes_are_not_roman_numerals(text: str, letter: str) -> None:
    # _ROMAN_ZH reads a lone V / X before 型 as 五 / 十; V型 and X型 are shapes in Chinese.
    out = read(text)
    assert "五型" not in out and "十型" not in out, out
    assert letter in out, out


@pytest.mark.parametrize(
    "text",
    [
        "The word philosophy comes from the Greek φιλοσοφία, meaning love of wisdom.",
        "The Greek word λόγος (logos) means word or reason.",
        "Athens is Αθήνα in Greek.",
    ],
)
def test_greek_words_are_not_spelled_letter_by_letter(text: str) -> None:
    # _GREEK_LETTERS in _SYMBOLS: a Greek word becomes "phi iota lambda sigma phi iota
    # alpha" (letters it lacks, ο ς Α, silently dropped); it was dropped whole before.
    out = read(text)
    assert "lambda" not in out and "iota" not in out and "theta eta" not in out, out


@pytest.mark.parametrize(
    ("text", "wrong"),
    [
        ("The laptop has 16GB/1TB and a 14-inch screen.", "per one terabyte"),
        ("This 144Hz/1ms panel is great for gaming.", "per one millisecond"),
        ("It's a 65W/20V USB-C charger.", "per twenty volts"),
        ("The battery is 3.7V/2000mAh.", "per two thousand"),
        ("Drink a 500 ml/17 oz bottle of water.", "per seventeen ounces"),
        ("The water bottle holds 32 oz/1 L.", "per one liter"),
        ("Each portion is 150 g/300 kcal.", "per three hundred kilocalories"),
    ],
)
def test_two_specs_or_a_conversion_keep_their_slash(text: str, wrong: str) -> None:
    # _PER_AMOUNT says "per" for any two units not listed as one kind in _UNIT_KINDS:
    # storage sizes, refresh rate / response time, watts / volts, and fluid ounces (oz is
    # listed as a mass) are read as rates. 8460843 said "slash".
    out = read(text)
    assert wrong not in out, out


@pytest.mark.parametrize(
    "text",
    [
        "The perimeter is 4 x 5 cm = 20 cm.",
        "Total length = 5 x 12 inches = 60 inches.",
    ],
)
def test_a_product_of_lengths_is_times_not_by(text: str) -> None:
    # _SIZE_AFTER makes a spaced "x" before a length "by" ("four by five centimeters
    # equals twenty centimeters"); _PRODUCT_AFTER only looks right after the number, not
    # after its unit. 8460843 said "times".
    out = read(text)
    assert " by " not in out, out
    assert " times " in out, out


def test_capitalised_zip_verb_is_no_postal_cue() -> None:
    # _POSTAL_CUE_BEFORE takes a bare "Zip" (a sentence's first word, the verb) as a cue:
    # "Zip two five zero zero zero files"; the code's own comment says "zip 25000 images"
    # is the verb.
    out = read("Zip 25000 files into one archive.")
    assert "twenty five thousand" in out, out


def test_mu_glued_to_a_variable_is_mu() -> None:
    # _symbol reads a μ glued before a letter as the prefix "micro" even with no number
    # before it: the means μx and μy (or μₓ) are "micro x and micro y".
    out = read("The test compares μx and μy.")
    assert "micro" not in out, out
    assert "mu x" in out, out


def test_hundreds_of_millions_of_dollars() -> None:
    # _ROUND_MONEY_PLURAL: "$100s of millions" is "hundreds of dollars of millions".
    out = read("Companies spend $100s of millions on ads.")
    assert "hundreds of millions of dollars" in out, out


# --- new rules that miss what they were written for (wrong before and after) --------------


def test_size_in_inches_with_a_space_is_by() -> None:
    # _SIZE_AFTER has "in\b" with no space allowed before it: "12 x 24in" is by, but
    # "8.5 x 11 in." (as US letter is written) stays "eight point five times eleven in".
    out = read("US letter is 8.5 x 11 in.")
    assert "eleven" in out and " by " in out, out


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("Hemoglobin is 13.5 g/dL.", "grams per deciliter"),
        ("Albumin 4.0 g/dL is normal.", "grams per deciliter"),
        ("血红蛋白13.5g/dL。", "克每分升"),
    ],
)
def test_grams_per_deciliter(text: str, want: str) -> None:
    # "/dL" is now "per deciliter", but _GRAMS_CONTEXT still leaves the "g" before it:
    # "thirteen point five g per deciliter", 十三点五g每分升.
    out = read(text)
    assert want in out, out


def test_zh_chi_square_with_a_plain_2() -> None:
    # Chinese papers write χ2检验 (no superscript): 卡方二检验.
    out = read("χ2检验显示差异有统计学意义。")
    assert "卡方检验" in out, out


def test_zh_range_of_ages_is_no_minus() -> None:
    # "6个月-2岁": 六个月负两岁 (a minus after a Chinese character); 六个月到两岁.
    out = read("宝宝6个月-2岁需要补充维生素D。")
    assert "负" not in out, out
