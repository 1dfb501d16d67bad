"""Found by review of the readings added in b3b7d0e (lab units, blood pressure, "per" an amount,
401(k), zip codes, Greek letters, Roman numerals): readings a listener would call wrong.

Each case is what a language model writes in a health, cooking, travel, finance or shopping
answer; ``present`` must be in the reading, ``absent`` must not.
"""

from __future__ import annotations

import pytest

from agent.text.normalize import normalize_for_tts
from agent.text.segment import split_text


def read(text: str) -> str:
    return " ".join(normalize_for_tts(piece) for piece in split_text(text))


@pytest.mark.parametrize(
    ("text", "present", "absent"),
    [
        # _retirement_plan reads the first and last digit: 457 was "four oh seven"
        ("Teachers often have a 403(b) and a 457(b).", "four fifty seven b", "four oh seven"),
        # a plural account is still the account ("four hundred one, k, s")
        ("Roth 401(k)s and IRAs are both good.", "four oh one k", "hundred"),
        # _PER_AMOUNT: a unit and its conversion after a slash is no rate
        ("Preheat the oven to 200°C/400°F.", "Celsius", "per four hundred"),
        ("Add 250g/9oz plain flour.", "nine ounces", "per nine"),
        ("The bag allowance is 23 kg/50 lb.", "fifty pounds", "per fifty"),
        ("Speed limit is 70 mph/113 km/h.", "one hundred thirteen", "per one hundred thirteen"),
        ("He is 6 ft/183 cm tall.", "centimeters", "per one hundred"),
        # "per" (from _PER_AMOUNT) is taken by _ARTICLE_BEFORE: the amount went singular
        ("My car gets 6.5 L/100km on the highway.", "one hundred kilometers on", "kilometer on"),
        # _NUMBERED_TITLE: the pronoun "I" after "stage", "type", "phase", a name "Mark"
        ("At this stage I would recommend seeing a doctor.", "stage I would", "one would"),
        ("This is the type I prefer for running.", "type I prefer", "one prefer"),
        ("Tell Mark I said hello.", "Mark I said", "one said"),
        # _NUMBERED_TITLE: letters that are no numerals
        ("Isotretinoin is pregnancy Category X.", "Category X", "ten"),
        ("Use Type X drywall for fire-rated walls.", "Type X", "ten"),
        ("In vim, type V to enter visual line mode.", "type V", "five"),
        # _REGNAL: a middle or surname initial; no monarch or pope has a number above 23
        ("John L Smith is a lawyer.", "John L Smith", "fiftieth"),
        ('"Great product!" - Mary V., Texas', "Mary V", "fifth"),
        # _PRESSURE_PAIR: a cue word is no proof every pair after it is a pressure
        ("Lower your blood pressure with the 80/20 rule.", "eighty twenty", "over"),
        ("Record your blood pressure on 12/15.", "December fifteenth", "over"),
        ("The BP monitor costs $50/60 at most stores.", "fifty dollars", "dollars fifty"),
        ("血压计的价格在100/200元之间。", "一百", "高压"),
        ("高压锅一般压20/30分钟就可以了。", "二十", "低压"),
        # ... and a second reading in the same breath, or a cue 33+ characters back, is missed
        ("BP readings: 128/82 in the morning, 135/88 at night.", "thirty five over", "slash"),
        ("Your blood pressure reading this morning was 130/80.", "thirty over eighty", "slash"),
        # Greek letters with an exponent: the "²" is lost ("sigma two", 卡方二)
        ("The variance σ² equals 4.", "sigma squared", "sigma two"),
        ("The χ² test checks independence.", "chi squared", "chi two"),
        ("χ²检验用于检验独立性。", "卡方检验", "卡方二"),
        # _POSTAL_CODE: ", XX " before five digits is not always a state before a zip code
        ("Average salaries: CA 84531, NY 87738, TX 58887.", "eighty seven thousand", "eight seven"),
        ("You can zip 25000 images into one archive.", "twenty five thousand", "two five"),
        # _ROUND_MONEY_PLURAL: a range lost its "to"
        ("It costs $100s-$1000s to repair.", "hundreds to thousands", "dollars, thousands"),
        # micro prefixes beyond the four listed: "mu" is read as a word before the unit
        ("Creatinine is 88 μmol/L.", "micromoles per liter", "mu"),
        ("Use a 10 μF capacitor.", "microfarad", "mu"),
        # a range of the new time units says "to"
        ("Ages 6 mos-2 yrs.", "six months to two years", "months two"),
        # Chinese lab units after a slash: the letters were left ("毫克每dL", "毫摩尔每L")
        ("总胆固醇应低于200mg/dL。", "每分升", "dL"),
        ("空腹血糖正常值为3.9-6.1mmol/L。", "每升", "L"),
    ],
)
def test_reading(text: str, present: str, absent: str) -> None:
    got = read(text)
    assert present in got, got
    assert absent not in got, got
