"""Spell text out the way a person would read it aloud, before ChatTTS sees it.

ChatTTS 0.2.5's own normalizer keeps only CJK ideographs (U+4E00..U+9FFF), A-Za-z,
``，。、,.`` and space; everything else is silently dropped ("3 pm!" -> " pm."). So
numbers, prices, times, dates, units and symbols are turned into words here, in English
or in Chinese, and the punctuation it would drop is mapped onto the few marks it keeps
(they carry the pauses). The result contains only characters ChatTTS keeps.

The reading language is decided per text: any CJK ideograph means a Chinese reading
(mixed text is mostly Chinese with English words in it), unless ``lang`` says otherwise.

The rules are applied in order, most specific first (a date before a range before a
bare number), each one replacing what it matched by words so later rules never see it.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from decimal import Decimal
from functools import partial
from types import MappingProxyType
from typing import Final

__all__ = [
    "ALLOWED_CHARS",
    "normalize_for_tts",
    "read_int_en",
    "read_int_zh",
    "read_number_en",
    "read_number_zh",
    "read_year_en",
    "reads_aloud",
]

ALLOWED_CHARS: Final = re.compile(r"[\u4e00-\u9fffA-Za-z，。、,. ]*")
"""Everything ChatTTS 0.2.5's normalizer keeps (use with ``fullmatch``)."""

_CJK: Final = re.compile(r"[\u4e00-\u9fff]")
_CJK_OR_MARK: Final = re.compile(r"[\u4e00-\u9fff\u3001-\u303f]")  # 。、「」《》...
_NOT_ALLOWED: Final = re.compile(r"[^\u4e00-\u9fffA-Za-z，。、,. ]")

# ----------------------------------------------------------------------------- numbers

# fmt: off
_ONES: Final = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
    "eighteen", "nineteen",
)
_TENS: Final = (
    "", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety",
)
# fmt: on
_SCALES: Final = (
    (10**15, "quadrillion"),
    (10**12, "trillion"),
    (10**9, "billion"),
    (10**6, "million"),
    (1000, "thousand"),
)
_ORDINAL_WORDS: Final = MappingProxyType(
    {
        "one": "first",
        "two": "second",
        "three": "third",
        "five": "fifth",
        "eight": "eighth",
        "nine": "ninth",
        "twelve": "twelfth",
    }
)
_ZH_DIGITS: Final = "零一二三四五六七八九"
_ZH_GROUPS: Final = ("", "万", "亿", "万亿")
# Longer digit strings are codes or IDs, not quantities: read them digit by digit.
_MAX_CARDINAL_DIGITS: Final = 15


def read_int_en(n: int) -> str:
    """English cardinal without hyphens or "and" ("twenty one", ChatTTS drops hyphens)."""
    if n < 0:
        return "minus " + read_int_en(-n)
    if n < 20:
        return _ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return _TENS[tens] + (" " + _ONES[ones] if ones else "")
    if n < 1000:
        hundreds, rest = divmod(n, 100)
        return _ONES[hundreds] + " hundred" + (" " + read_int_en(rest) if rest else "")
    for value, name in _SCALES:
        if n >= value:
            high, rest = divmod(n, value)
            return read_int_en(high) + " " + name + (" " + read_int_en(rest) if rest else "")
    raise AssertionError("unreachable")  # pragma: no cover


def _ordinal_en(words: str) -> str:
    """Turn the last word of a cardinal into its ordinal form (twenty one -> twenty first)."""
    head, _, last = words.rpartition(" ")
    if last in _ORDINAL_WORDS:
        last = _ORDINAL_WORDS[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return f"{head} {last}" if head else last


def _plural_en(words: str) -> str:
    """Plural of a number phrase (nineteen ninety -> nineteen nineties)."""
    return words[:-1] + "ies" if words.endswith("y") else words + "s"


def read_year_en(year: int) -> str:
    """Years the way they are said: 1984 nineteen eighty four, 2005 two thousand five."""
    if not 1000 <= year <= 2999 or 2000 <= year <= 2009:
        return read_int_en(year)
    high, low = divmod(year, 100)
    if low == 0:
        return read_int_en(year) if year % 1000 == 0 else read_int_en(high) + " hundred"
    if low < 10:
        return f"{read_int_en(high)} oh {_ONES[low]}"
    return f"{read_int_en(high)} {read_int_en(low)}"


def _zh_section(n: int) -> str:
    """0 < n < 10000, with 零 for inner gaps (1005 -> 一千零五)."""
    out = ""
    gap = False
    for value, unit in ((1000, "千"), (100, "百"), (10, "十"), (1, "")):
        digit = n // value % 10
        if digit == 0:
            gap = bool(out)
            continue
        if gap:
            out += "零"
            gap = False
        out += _ZH_DIGITS[digit] + unit
    return out


def read_int_zh(n: int) -> str:
    """Chinese cardinal: 10010 -> 一万零一十, 15 -> 十五."""
    if n < 0:
        return "负" + read_int_zh(-n)
    if n == 0:
        return "零"
    if n >= 10 ** (4 * len(_ZH_GROUPS)):
        return _digits(str(n), zh=True)  # beyond 万亿: read digit by digit
    groups: list[int] = []
    rest = n
    while rest:
        rest, group = divmod(rest, 10000)
        groups.append(group)
    out = ""
    pending_zero = False
    for index in reversed(range(len(groups))):
        group = groups[index]
        if group == 0:
            pending_zero = bool(out)
            continue
        if out and (pending_zero or group < 1000):
            out += "零"
        out += _zh_section(group) + _ZH_GROUPS[index]
        pending_zero = False
    # 一十五 is written but 十五 is said; and 两千, 两万, 两亿 (二千元 is no one's reading).
    if out.startswith("一十"):
        return out[1:]
    return "两" + out[1:] if out.startswith(("二千", "二万", "二亿")) else out


def _digits(digits: str, zh: bool) -> str:
    if zh:
        return "".join(_ZH_DIGITS[int(d)] for d in digits)
    return " ".join(_ONES[int(d)] for d in digits)


def _int_words(digits: str, zh: bool) -> str:
    """A whole number's words; digit by digit past _MAX_CARDINAL_DIGITS, like _read_number:
    int() refuses more than 4300 digits (a ValueError, which failed the utterance and counted
    towards the engine's circuit breaker; found by review), and no one says such a number."""
    if len(digits) > _MAX_CARDINAL_DIGITS:
        return _digits(digits, zh)
    return read_int_zh(int(digits)) if zh else read_int_en(int(digits))


def _read_number(int_part: str, frac: str | None, zh: bool) -> str:
    """Read ``int_part[.frac]`` (int_part may hold thousands commas) in either language."""
    int_part = int_part.replace(",", "")
    if int_part.startswith("0") and len(int_part) > 1 and not frac:
        return _digits(int_part, zh)  # 007, 0800: a code, not a quantity
    if len(int_part) > _MAX_CARDINAL_DIGITS:
        whole = _digits(int_part, zh)
    elif zh:
        whole = read_int_zh(int(int_part or "0"))
    else:
        whole = read_int_en(int(int_part or "0"))
    if not frac:
        return whole
    return whole + ("点" if zh else " point ") + _digits(frac, zh)


def read_number_en(number: str) -> str:
    """English reading of a plain number string such as ``-1,234.5``."""
    neg = number.startswith("-")
    int_part, _, frac = number.lstrip("-").partition(".")
    return ("minus " if neg else "") + _read_number(int_part, frac or None, zh=False)


def read_number_zh(number: str) -> str:
    """Chinese reading of a plain number string such as ``-1,234.5``."""
    neg = number.startswith("-")
    int_part, _, frac = number.lstrip("-").partition(".")
    return ("负" if neg else "") + _read_number(int_part, frac or None, zh=True)


# ------------------------------------------------------------------------ tables


@dataclass(frozen=True)
class _Currency:
    one: str
    many: str
    sub_one: str | None
    sub_many: str | None
    zh: str


_DOLLAR: Final = _Currency("dollar", "dollars", "cent", "cents", "美元")
_EURO: Final = _Currency("euro", "euros", "cent", "cents", "欧元")
_POUND: Final = _Currency("pound", "pounds", "penny", "pence", "英镑")
_CURRENCIES: Final[Mapping[str, _Currency]] = MappingProxyType(
    {
        "$": _DOLLAR,
        "€": _EURO,
        "£": _POUND,
        "¥": _Currency("yen", "yen", None, None, "元"),  # ¥ in Chinese text is the yuan
        "USD": _Currency("US dollar", "US dollars", "cent", "cents", "美元"),
        "EUR": _EURO,
        "GBP": _POUND,
        "JPY": _Currency("yen", "yen", None, None, "日元"),
        "CNY": _Currency("yuan", "yuan", None, None, "元"),
        "RMB": _Currency("yuan", "yuan", None, None, "元人民币"),
    }
)
_SCALE_WORDS: Final[Mapping[str, tuple[str, str]]] = MappingProxyType(
    {
        "k": ("thousand", "千"),
        "thousand": ("thousand", "千"),
        "m": ("million", "百万"),
        "mn": ("million", "百万"),
        "million": ("million", "百万"),
        "b": ("billion", "十亿"),
        "bn": ("billion", "十亿"),
        "billion": ("billion", "十亿"),
        "t": ("trillion", "万亿"),
        "trillion": ("trillion", "万亿"),
        "万": ("ten thousand", "万"),  # "¥3.5万": 三万五千元, not 三点五元万
        "亿": ("hundred million", "亿"),
    }
)
_SCALE_VALUES: Final[Mapping[str, int]] = MappingProxyType(
    {
        "thousand": 10**3,
        "ten thousand": 10**4,
        "million": 10**6,
        "hundred million": 10**8,
        "billion": 10**9,
        "trillion": 10**12,
    }
)
# unit -> (English singular, English plural, Chinese)
_UNITS: Final[Mapping[str, tuple[str, str, str]]] = MappingProxyType(
    {
        "°C": ("degree Celsius", "degrees Celsius", "摄氏度"),
        "°F": ("degree Fahrenheit", "degrees Fahrenheit", "华氏度"),
        "°": ("degree", "degrees", "度"),
        "km/h": ("kilometer per hour", "kilometers per hour", "公里每小时"),
        "kph": ("kilometer per hour", "kilometers per hour", "公里每小时"),
        "mph": ("mile per hour", "miles per hour", "英里每小时"),
        "m/s": ("meter per second", "meters per second", "米每秒"),
        "km": ("kilometer", "kilometers", "公里"),
        "cm": ("centimeter", "centimeters", "厘米"),
        "mm": ("millimeter", "millimeters", "毫米"),
        "m": ("meter", "meters", "米"),
        "kg": ("kilogram", "kilograms", "公斤"),
        "g": ("gram", "grams", "克"),
        "mg": ("milligram", "milligrams", "毫克"),
        # micro units as NFKD leaves them (the micro sign U+00B5 becomes Greek mu, U+03BC):
        # the mu was dropped, and "10 µm" was "ten m" (found in an earlier note)
        "\u03bcm": ("micrometer", "micrometers", "微米"),
        "\u03bcg": ("microgram", "micrograms", "微克"),
        "mcg": ("microgram", "micrograms", "微克"),
        "\u03bcs": ("microsecond", "microseconds", "微秒"),
        "\u03bcmol": ("micromole", "micromoles", "微摩尔"),
        "\u03bcF": ("microfarad", "microfarads", "微法"),
        "\u03bcA": ("microamp", "microamps", "微安"),
        "\u03bcV": ("microvolt", "microvolts", "微伏"),
        "nF": ("nanofarad", "nanofarads", "纳法"),
        "pF": ("picofarad", "picofarads", "皮法"),
        "\u03bcL": ("microliter", "microliters", "微升"),
        "\u03bcl": ("microliter", "microliters", "微升"),
        "nm": ("nanometer", "nanometers", "纳米"),
        # resistance: the ohm sign and Greek omega are one after NFKD
        "k\u03a9": ("kilohm", "kilohms", "千欧"),
        "M\u03a9": ("megohm", "megohms", "兆欧"),
        "\u03a9": ("ohm", "ohms", "欧"),
        "ns": ("nanosecond", "nanoseconds", "纳秒"),
        # lab values and vital signs ("100 mg/dL", "5.6 mmol/L", "120/80 mmHg", "60 bpm")
        "dL": ("deciliter", "deciliters", "分升"),
        "mmol": ("millimole", "millimoles", "毫摩尔"),
        "mmHg": ("millimeter of mercury", "millimeters of mercury", "毫米汞柱"),
        "kcal": ("kilocalorie", "kilocalories", "千卡"),
        "bpm": ("beat per minute", "beats per minute", "次每分钟"),
        # short forms of time ("5 yrs old", "6 mos", "2 wks"), read only after a number
        "yrs": ("year", "years", "年"),
        "yr": ("year", "years", "年"),
        "mos": ("month", "months", "个月"),
        "mo": ("month", "months", "个月"),
        "wks": ("week", "weeks", "周"),
        "wk": ("week", "weeks", "周"),
        "lbs": ("pound", "pounds", "磅"),
        "lb": ("pound", "pounds", "磅"),
        "oz": ("ounce", "ounces", "盎司"),
        "ft": ("foot", "feet", "英尺"),
        "sq ft": ("square foot", "square feet", "平方英尺"),
        "mi": ("mile", "miles", "英里"),
        "tsp": ("teaspoon", "teaspoons", "茶匙"),
        "tbsp": ("tablespoon", "tablespoons", "汤匙"),
        "fps": ("frame per second", "frames per second", "帧每秒"),
        "mAh": ("milliamp hour", "milliamp hours", "毫安时"),
        "V": ("volt", "volts", "伏"),
        "W": ("watt", "watts", "瓦"),
        "ml": ("milliliter", "milliliters", "毫升"),
        "mL": ("milliliter", "milliliters", "毫升"),
        "L": ("liter", "liters", "升"),
        "kWh": ("kilowatt hour", "kilowatt hours", "千瓦时"),
        "kW": ("kilowatt", "kilowatts", "千瓦"),
        "GHz": ("gigahertz", "gigahertz", "吉赫兹"),
        "MHz": ("megahertz", "megahertz", "兆赫兹"),
        "kHz": ("kilohertz", "kilohertz", "千赫兹"),
        "Hz": ("hertz", "hertz", "赫兹"),
        "TB": ("terabyte", "terabytes", "TB"),
        "GB": ("gigabyte", "gigabytes", "GB"),
        "MB": ("megabyte", "megabytes", "MB"),
        "KB": ("kilobyte", "kilobytes", "KB"),
        "ms": ("millisecond", "milliseconds", "毫秒"),
        "mins": ("minute", "minutes", "分钟"),
        "min": ("minute", "minutes", "分钟"),
        "secs": ("second", "seconds", "秒"),
        "sec": ("second", "seconds", "秒"),
        "Gbps": ("gigabit per second", "gigabits per second", "吉比特每秒"),
        "Mbps": ("megabit per second", "megabits per second", "兆比特每秒"),
        "kbps": ("kilobit per second", "kilobits per second", "千比特每秒"),
        "hrs": ("hour", "hours", "小时"),
        "hr": ("hour", "hours", "小时"),
        "h": ("hour", "hours", "小时"),
    }
)
# Units read only glued to their number ("12V", "100W"): "I-90 W" and "Exit 5 W" are west;
# and not after a road's or an exit's name ("Route 9W", "I-35W", "Exit 16W").
_GLUED_ONLY_UNITS: Final = frozenset({"V", "W"})
_ROAD_BEFORE: Final = re.compile(
    r"(?:\b(?:Route|Rte|Rt|Exit|Highway|Hwy|Interstate|Road|Rd|Street|St|Avenue|Ave)\.?\s*|"
    r"\b[A-Z]{1,2}-\s?)$",
    re.IGNORECASE,
)
# Units that "^2" / "^3" make an area or a volume: "50 m²" is fifty square meters.
_LENGTH_UNITS: Final = frozenset({"km", "cm", "mm", "m", "ft", "\u03bcm", "nm"})
# fmt: off
_MONTHS: Final = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
)
# fmt: on
_MONTH_BY_NAME: Final[Mapping[str, int]] = MappingProxyType(
    {
        **{name: i + 1 for i, name in enumerate(_MONTHS)},
        **{name[:3]: i + 1 for i, name in enumerate(_MONTHS)},
        "Sept": 9,
    }
)
# Greek letters as maths and science write them ("μ = 5", "σ", "ΔT", "α and β" were read with
# the letter dropped). NFKD makes the micro sign Greek mu: alone, it is said "mu".
# fmt: off
_GREEK_LETTERS: Final[Mapping[str, tuple[str, str]]] = MappingProxyType({
    "\u03b1": ("alpha", "阿尔法"), "\u03b2": ("beta", "贝塔"), "\u03b3": ("gamma", "伽马"),
    "\u03b4": ("delta", "德尔塔"), "\u0394": ("delta", "德尔塔"), "\u03b5": ("epsilon", "艾普西隆"),
    "\u03b8": ("theta", "西塔"), "\u03bb": ("lambda", "拉姆达"), "\u03bc": ("mu", "缪"),
    "\u03c3": ("sigma", "西格玛"), "\u03a3": ("sigma", "西格玛"), "\u03c4": ("tau", "套"),
    "\u03c6": ("phi", "斐"), "\u03a6": ("phi", "斐"), "\u03c9": ("omega", "欧米伽"),
    "\u03a9": ("omega", "欧米伽"), "\u03c1": ("rho", "柔"), "\u03b7": ("eta", "伊塔"),
    "\u03c7": ("chi", "卡方"), "\u03c8": ("psi", "普西"), "\u0398": ("theta", "西塔"),
    "\u0393": ("gamma", "伽马"), "\u03a0": ("pi", "派"), "\u03ba": ("kappa", "卡帕"),
    "\u03bd": ("nu", "纽"), "\u039b": ("lambda", "拉姆达"), "\u03a8": ("psi", "普西"),
    "\u03be": ("xi", "克西"), "\u03b6": ("zeta", "泽塔"), "\u03b9": ("iota", "约塔"),
})
# fmt: on
# Two Greek letters side by side: a word, not maths (which writes "ΔT", "μx").
_GREEK_WORD: Final = re.compile("[\u0370-\u03ff]{2}|.[\u0370-\u03ff]{2}")
# Symbols left after the number rules; longest first so "°C" wins over "°".
_SYMBOLS: Final[Mapping[str, tuple[str, str]]] = MappingProxyType(
    {
        "°C": ("degrees Celsius", "摄氏度"),
        "°F": ("degrees Fahrenheit", "华氏度"),
        "°": ("degrees", "度"),
        "§§": ("sections", "第"),
        "§": ("section", "第"),
        "¶": ("paragraph", "段"),
        "&": ("and", "和"),
        "@": ("at", "at"),
        "+": ("plus", "加"),
        "=": ("equals", "等于"),
        "%": ("percent", "百分号"),
        "×": ("times", "乘"),
        "÷": ("divided by", "除以"),
        "√": ("the square root of", "根号"),
        "π": ("pi", "派"),
        "≈": ("approximately", "约等于"),
        "±": ("plus or minus", "正负"),
        "→": ("to", "到"),
        "≠": ("is not equal to", "不等于"),
        "≤": ("is at most", "小于等于"),
        "≥": ("is at least", "大于等于"),
        "$": ("dollars", "美元"),
        "€": ("euros", "欧元"),
        "£": ("pounds", "英镑"),
        "¥": ("yen", "元"),
        **_GREEK_LETTERS,
    }
)
# Abbreviations whose dot is not a sentence end; value is the spoken form.
_ABBREVIATIONS: Final[Mapping[str, tuple[str, str]]] = MappingProxyType(
    {
        "Mr.": ("Mister", "先生"),
        "Mrs.": ("Missus", "夫人"),
        "Ms.": ("Miz", "女士"),
        "Dr.": ("Doctor", "博士"),
        "Prof.": ("Professor", "教授"),
        "e.g.": ("for example", "例如"),
        "i.e.": ("that is", "也就是"),
        "etc.": ("et cetera", "等等"),
        "vs.": ("versus", "对"),
        "approx.": ("approximately", "大约"),
        "Fig.": ("figure", "图"),
        "Figs.": ("figures", "图"),
        "Vol.": ("volume", "卷"),
        "Eq.": ("equation", "公式"),
        "Ch.": ("chapter", "章"),
        "pp.": ("pages", "页"),
        "Ave.": ("Avenue", "大道"),
        "Blvd.": ("Boulevard", "大道"),
        "Gov.": ("Governor", "州长"),
        "Sen.": ("Senator", "参议员"),
        "Rep.": ("Representative", "众议员"),
        "Gen.": ("General", "将军"),
        "Lt.": ("Lieutenant", "中尉"),
        "Capt.": ("Captain", "上尉"),
        "Col.": ("Colonel", "上校"),
        "Sgt.": ("Sergeant", "中士"),
    }
)
# What may follow "/" to be read "per"; short forms are said in full.
_PER_WORDS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "hour": "hour",
        "hr": "hour",
        "h": "hour",
        "day": "day",
        "night": "night",
        "week": "week",
        "wk": "week",
        "month": "month",
        "mo": "month",
        "year": "year",
        "yr": "year",
        "person": "person",
        "head": "head",
        "unit": "unit",
        "item": "item",
        "user": "user",
        "seat": "seat",
        "kg": "kilogram",
        "lb": "pound",
        "oz": "ounce",
        "gal": "gallon",
        "mL": "milliliter",
        "ml": "milliliter",
        "dL": "deciliter",
        "L": "liter",
        "g": "gram",
        "km": "kilometer",
        "mile": "mile",
        "min": "minute",
        "minute": "minute",
        "second": "second",
        "sec": "second",
        "s": "second",
        "GB": "gigabyte",
        "MB": "megabyte",
        "TB": "terabyte",
        "kWh": "kilowatt hour",
        "token": "token",
        "serving": "serving",
        "share": "share",
        "bbl": "barrel",
        "barrel": "barrel",
        "sq ft": "square foot",
        "sqft": "square foot",
        "request": "request",
    }
)

# ------------------------------------------------------------------------ patterns

_INT: Final = r"[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+"
# Never from inside a run of digits: from every digit of a long run ("https://000...0 USD",
# a URL held whole, up to 5000 characters) the rules that want a unit after the number
# backtracked over the rest of the run: quadratic, 4 s with the GIL held (found by review).
_NUM: Final = rf"(?<![0-9])(?:{_INT})(?:\.[0-9]+)?"
_AMPM: Final = r"(?P<ampm>[AaPp])\.?[Mm](?![A-Za-z])\.?"
# A URL is ASCII: the first non-ASCII character ends it. Chinese is written with no space
# after a URL ("打开https://x.com/login然后登录"), and only its host is read: a URL that ran
# to the next space dropped those words unspoken. Except a host that starts non-ASCII (an
# internationalised name, "https://例子.测试"): it runs to the end of the host, all of it read,
# then its path is ASCII as any other's.
# Unicode's whitespace too (re.ASCII's \s is ASCII's), as the segmenter's _URL has it.
_URL_IDN_HOST: Final = (
    r"(?=[^\x00-\x7f])"
    r"[^\s\x1c-\x1f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000<>\"'/?#，。、；：！？（）]+"
)
_URL_ASCII: Final = r"[^\s<>\"'\x80-\U0010FFFF]"
_URL: Final = re.compile(
    rf"\b(?:https?://|www\.)(?:{_URL_ASCII}+|{_URL_IDN_HOST}(?:[/?#]{_URL_ASCII}*)?)",
    re.IGNORECASE | re.ASCII,
)
# A match starts only where a run of its characters does: from every word boundary of a long
# dotted run with no "@" ("1.1.1.1...") it scanned to the run's end (quadratic; found by review).
_EMAIL: Final = re.compile(
    r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+\b", re.ASCII
)
# A bare domain, and its path, which is not said (as a URL's: "github.com/user/repo" was
# "github dot com per user slash repo"). A match starts only where a run of its characters
# does: from every word boundary of a long dashed run it scanned to the run's end (quadratic).
_DOMAIN: Final = re.compile(
    r"(?<![A-Za-z0-9_.-])(?P<domain>[a-z0-9-]+(?:\.[a-z0-9-]+)*"
    r"\.(?:com|org|net|io|ai|dev|edu|gov|cn|co|uk|de|app))\b(?:/[^\s<>\"'\x80-\U0010FFFF]*)?",
    re.ASCII,
)
_ACRONYM: Final = re.compile(r"\b(?:[A-Za-z]\.){2,}", re.ASCII)
# A dotted name in code ("os.path", "json.loads", "torch.nn.Module", "Math.max"), said with
# "dot" as programmers do ("json. loads" before: the dot read as a full stop). After the
# URL, domain, file-name, abbreviation and acronym rules; a capital after the first dot is a
# missing space ("St.Louis"), not code.
_DOTTED_NAME: Final = re.compile(
    r"(?<![A-Za-z0-9_.@/-])[A-Za-z_][A-Za-z0-9_]*(?:\.[a-z_][A-Za-z0-9_]*)"
    r"(?:\.[A-Za-z_][A-Za-z0-9_]*)*(?![A-Za-z0-9_@])",
    re.ASCII,
)
# "p. 7": a page before its number ("pp." is an abbreviation of its own).
_PAGE: Final = re.compile(r"(?<![A-Za-z.])p\.\s?(?=[0-9])", re.ASCII)
# Service numbers after the word that dials them are said digit by digit ("Call 911": nine
# one one, not nine hundred eleven); so is "a 911 call".
_SERVICE_NUMBER: Final = re.compile(
    r"(?:(?<=\b[Cc]all\s)|(?<=\b[Dd]ial\s)|(?<=\b[Tt]ext\s)|(?<=\b[Cc]alling\s)"
    r"|(?<=\b[Dd]ialing\s)|(?<=\b[Tt]exting\s))(?P<n>911|999|112|988|311|411|211|111|000)"
    r"(?![0-9]|[.,:/-][0-9])"
    r"|(?<![0-9])(?P<m>911)(?=\s(?:call|calls|dispatch|dispatcher|dispatchers|operator)\b)",
    re.ASCII,
)
_ISO_DATE: Final = re.compile(
    r"(?<![0-9.])(?P<y>[0-9]{4})(?P<sep>[-/.])(?P<m>0?[1-9]|1[0-2])(?P=sep)"
    r"(?P<d>0?[1-9]|[12][0-9]|3[01])(?![0-9]|\.[0-9])"
)
# A date with its year last: 12/25/2024 (the US order), 25/12/2024, 25.12.2024 (day first).
# Read as "twelve slash twenty five slash two thousand twenty four" before. Only with four
# year digits: "3/4/5" is no date. Which end is the month: the one that can be (<= 12);
# when both can, "/" is month first (the US order, and English is where it is written so),
# "." day first (as German and most of Europe write it).
_DATE_YEAR_LAST: Final = re.compile(
    r"(?<![0-9./])(?P<a>0?[1-9]|[12][0-9]|3[01])(?P<sep>[/.])(?P<b>0?[1-9]|[12][0-9]|3[01])"
    r"(?P=sep)(?P<y>[0-9]{4})(?![0-9]|[./][0-9])"
)
_MONTH_DAY: Final = re.compile(
    r"\b(?P<month>" + "|".join(sorted(_MONTH_BY_NAME, key=len, reverse=True)) + r")\.?"
    r"\s+(?P<d>[12][0-9]|3[01]|0?[1-9])(?:st|nd|rd|th)?(?![0-9])"
    # a range of days ("June 10-12": the dash was read as a minus)
    r"(?:\s?[-–]\s?(?P<d2>[12][0-9]|3[01]|0?[1-9])(?:st|nd|rd|th)?(?![0-9]))?"
    r"(?:,?\s+(?P<y>[0-9]{4})(?![0-9]))?",
    re.ASCII,
)
_CLOCK: Final = re.compile(
    rf"(?<![0-9])(?<![0-9]:)(?P<h>[0-9]{{1,2}}):(?P<m>[0-5][0-9])(?::(?P<s>[0-5][0-9]))?(?![0-9])"
    rf"(?:\s?{_AMPM})?"
)
# One end of a time range: "9", "9am", "10:30", "5 p.m." (_time_end tells which are times).
_TIME: Final = r"[0-9]{1,2}(?::[0-5][0-9]){0,2}(?:\s?[AaPp]\.?[Mm](?![A-Za-z])\.?)?"
# Before the clock rules, which would leave the dash between two times to become a pause.
# A ":" before either may be a label's ("营业时间：9:00-21:00"), not a longer time's.
_TIME_RANGE: Final = re.compile(
    rf"(?<![0-9.])(?<![0-9]:)(?P<a>{_TIME})\s?[-–~～]\s?(?P<b>{_TIME})(?![0-9:])"
)
# "7.30pm", as British English writes a time: only with am/pm (else "7.30" is a number).
_DOTTED_CLOCK: Final = re.compile(rf"(?<![0-9.])(?P<h>1[0-2]|0?[1-9])\.(?P<m>[0-5][0-9])\s?{_AMPM}")
_HOUR_AMPM: Final = re.compile(rf"(?<![0-9:])(?<![0-9][.,])(?P<h>[0-9]{{1,2}})\s?{_AMPM}")
# "2.39:1" too; never from inside an address ("127.0.0.1:5000": _DOTTED reads it, and its
# port follows).
_RATIO: Final = re.compile(
    r"(?<![0-9.])(?P<a>[0-9]+(?:\.[0-9]+)?):(?P<b>[0-9]+(?:\.[0-9]+)?)(?![0-9])"
)
_PHONE: Final = re.compile(
    r"(?<![\w-])(?P<cc>\+[0-9]{1,3}[\s-]?)?(?:\((?P<area>[0-9]{3})\)\s?|(?P<area2>[0-9]{3})[\s.-])"
    r"(?P<a>[0-9]{3})-(?P<b>[0-9]{4})(?![\w-])"
)
# A local number ("555-1234") looks like a range ("100-1000"); a word that asks for a
# number just before it ("call", "phone", "fax: ", "text me at", 拨打, 电话) says which.
_LOCAL_PHONE: Final = re.compile(
    r"(?P<cue>(?i:(?<![A-Za-z])(?:call|phone|telephone|tel|fax|dial|text|mobile|cell)"
    r"[.:]?(?:\s+(?:me|us|him|her|them))?(?:\s+(?:at|on))?\s+)"
    r"|(?:电话|拨打|致电|手机|传真)(?:号码)?是?[：:]?\s*)"
    r"(?P<a>[0-9]{3})-(?P<b>[0-9]{4})(?![\w-])"
)
# A range has two ends: three or more dash-joined digit groups are a phone number or a code
# ("1-800-555-1234", "138-1234-5678", an ISBN), and so is a Chinese landline with its area
# code ("010-12345678": no range starts at 0). Read group by group, digit by digit.
_DIGIT_GROUPS: Final = re.compile(
    r"(?<![A-Za-z0-9_.-])(?:[0-9]+(?:-[0-9]+){2,}|0[0-9]{2,3}-[0-9]{7,8})(?![A-Za-z0-9_-])"
)
_DOTTED: Final = re.compile(r"(?<![0-9.])[0-9]+(?:\.[0-9]+){2,}(?![0-9])")
_RANGE: Final = re.compile(r"(?<=[0-9])(?:\s?[~～]\s?|[-–]|\s–\s|\sto\s)(?=[$€£¥]?[0-9])")
# A range with its unit on both ends ("10点-22点", "5元-10元", "3%-5%", "10kg-20kg"): the dash
# after a number's unit is "to". Left to _negative, a dash after a CJK character is a minus
# sign ("气温-5度"): "ten o'clock, minus twenty-two o'clock" (found by review).
# The same unit must close the second end: a connective is no unit ("-8到-3度", "3加-2").
_UNIT_RANGE: Final = re.compile(
    r"(?<=[0-9])(?P<unit>[%％]|°[CF]?|[\u4e00-\u9fff]|[A-Za-z]{1,3})[-–~～]"
    r"(?=[第$€£¥]?[0-9][0-9.,]*(?P=unit))"
)
_YEAR_RANGE: Final = re.compile(
    r"(?<![0-9])(?P<a>1[1-9][0-9]{2}|20[0-9]{2})(?:\s?[-–]\s?|\sto\s)"
    # "2023-24", a season or a school year: its end is the same century's
    r"(?P<b>1[1-9][0-9]{2}|20[0-9]{2}|(?<=[-–])[0-9]{2})(?![0-9])"
)
# A number glued to the letters before it, ending where a match starts ("i7" of "i7-12700").
_GLUED_NUMBER_BEFORE: Final = re.compile(r"[A-Za-z][0-9]+$")
# How far before a match these look (a window: from the text's start, every match scanned
# all the text before it, quadratic in a long text of matches).
_LOOK_BACK: Final = 32


def _before(pattern: re.Pattern[str], m: re.Match[str], group: int | str = 0) -> bool:
    """Whether ``pattern`` (anchored with ``$``) ends right where ``m`` (or its ``group``)
    starts, looking back _LOOK_BACK characters at most."""
    at = m.start(group)
    return pattern.search(m.string, max(0, at - _LOOK_BACK), at) is not None


_DIGITS_AT: Final = re.compile(r"[0-9]+")
# Spaced ("5 - 3"), or glued where an "=" follows the sum ("10-3=7": no range); before
# _RANGE, which would read the glued one "ten to three".
_MINUS_OP: Final = re.compile(r"(?<=[0-9])(?:\s+-\s+|[-–](?=[0-9][0-9.,]*\s?=))(?=[0-9])")
# ("5800X3D" is a model: an X between digits and a letter)
_TIMES_OP: Final = re.compile(r"(?<=[0-9])(?:\s?[*xX×]\s?(?=[0-9])(?![0-9]+[A-Z]))")
# Spaced between a variable (one lower-case letter) or a call's ")" and a number, as code
# and maths write them ("n - 1", "len(arr) - 1", "x * 2"): the dash was a pause.
_NAME_OP: Final = re.compile(
    r"(?:(?<=[^A-Za-z][a-z])|(?<=^[a-z])|(?<=\)))\s+(?P<op>[-*])\s+(?=[0-9])"
)
# A call before its ")" ("len(arr)"): "Lunch (12:00) - 1 hour" is a dash, not a minus.
# Nor is one before a number that counts a word ("part a - 3 points").
_WORD_AFTER_NUMBER: Final = re.compile(r"[0-9]+(?:[.,][0-9]+)*\s+[A-Za-z]")
_CALL_BEFORE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\([^()\s]*\)$")
# "20 ft x 15 ft", "6 in x 4 in": a size between two lengths (before _UNIT reads them).
_SIZE_BY: Final = re.compile(
    r"(?<=[0-9])(?P<unit>\s?(?:ft|in|cm|mm|m|km|inches|feet|meters)|[\"″])\s?[xX×]\s?(?=[0-9])",
    re.ASCII,
)
# "10x faster", "0.5x speed", "3× more": a factor, not the letter (after _TIMES_OP, which
# reads "3x4"; "x86", "v2x" and "0x1F" are left to the other rules).
# A capital X after four digits or more is a model's suffix ("Ryzen 9 7950X"), not a factor.
_FACTOR: Final = re.compile(
    r"(?<![A-Za-z0-9_.])(?<![=(])(?<![=(]\s)(?P<num>[0-9]+(?:\.[0-9]+)?)"
    r"(?:[x×]|(?<![0-9]{4})X)"
    # "2x + 3", "y = 2x", "5x = 10", "(3x)": an algebra term, said "two x"; but "2x/day"
    # is a count of times ("two x per day" before)
    r"(?![A-Za-z0-9_])(?!\s?[-+=*^<>)²³]|\s?/(?!(?:day|week|wk|month|mo|year|yr|hour|hr|night)\b))",
    re.ASCII,
)
_APPROX: Final = re.compile(r"(?<![0-9])[~～]\s?(?=[$€£¥]?[0-9])")
# Between spaces or numbers ("x < 3", "3<5"), or glued to a word before a number ("numpy<2.0").
_COMPARE: Final = re.compile(
    r"(?:(?<=[\s0-9])|(?<=[A-Za-z])(?=[<>]=?[0-9]))(?P<op>[<>]=?)(?=[\s0-9])"
)
_HASH_NUMBER: Final = re.compile(r"(?:#|(?<![A-Za-z])No\.\s?)(?P<n>[0-9]+)(?![0-9])")
# A scale after an amount: a letter ("2M") or a word ("2 million").
_SCALE_SUFFIX: Final = (
    r"[kK](?![A-Za-z])|[mMbB]n?(?![A-Za-z])|T(?![A-Za-z])|[万亿]"
    r"|\s?(?:thousand|million|billion|trillion)\b"
)
# "$10-20", "$1.5-2M", "€5k-10k", "$10 - $20": the currency and the scale are said once,
# after the range ("one point five dollars to two M" before: the first end was misread).
_MONEY_RANGE: Final = re.compile(
    rf"(?P<sym>[$€£¥])\s?(?P<a>{_NUM})(?P<ascale>{_SCALE_SUFFIX})?"
    # "to" only before money ("$10 to $20", "$10 to 20 million"): "$5 to 3 friends" is none
    rf"(?:[-–~]|\s[-–~]\s|\sto\s(?=(?P=sym)|[0-9.,]+(?:{_SCALE_SUFFIX})))"
    rf"(?:(?P=sym)\s?)?(?P<b>{_NUM})(?P<bscale>{_SCALE_SUFFIX})?(?![A-Za-z0-9]|[.,][0-9])",
    re.ASCII,
)
_CURRENCY_SYMBOL: Final = re.compile(
    rf"(?P<neg>-)?(?P<sym>[$€£¥])\s?(?P<num>{_NUM})"
    r"(?:\s?(?P<scale>thousand|million|billion|trillion)\b|(?P<abbr>[kK]|[mMbB]n?|T|[万亿])(?![A-Za-z]))?",
    re.ASCII,
)
_CURRENCY_CODE: Final = re.compile(
    rf"(?P<neg>-)?(?P<num>{_NUM})\s?(?P<scale>thousand|million|billion|trillion)?\s?"
    r"(?P<sym>USD|EUR|GBP|JPY|CNY|RMB)\b",
    re.ASCII,
)
_PERCENT: Final = re.compile(rf"(?P<neg>-)?(?P<num>{_NUM})\s?[%％]")
# "10M users", "2.5B requests", "15k stars": a number glued to a scale letter, as language
# models write counts (before: "ten M users"). Only past one digit or with a decimal point:
# "3M", "4K", "2B" and "5K" are as often names (a company, a screen, a pencil, a race) and
# are said letter by letter. After _UNIT, which reads "10m" and "10MB" first.
_SCALED_NUMBER: Final = re.compile(
    r"(?<![0-9A-Za-z.,])(?P<neg>-)?"
    r"(?P<num>(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]{2,})(?:\.[0-9]+)?|[0-9](?:\.[0-9]+)?)"
    r"(?P<abbr>[kKMBT]|[mb]n)(?![A-Za-z0-9])",
    re.ASCII,
)
# What a count glued to its scale letter is followed by: a word (a hyphen's too: "a 10M-row
# table") or, in Chinese, a character.
_WORD_AFTER_SCALE: Final = re.compile(r"(?:\s+|-)(?P<word>[a-z]+)|(?P<cjk>[\u4e00-\u9fff])")
_WORD_BEFORE: Final = re.compile(r"(?P<word>[A-Za-z]+)\s+$")
# What a single digit glued to a scale letter counts when it is an amount ("a 7B parameter
# model", "8M users"); before any other word it is a name ("3M tape", "a 4K screen").
_COUNTED_BY_ONE_DIGIT: Final = frozenset(
    {
        "parameter",
        "parameters",
        "params",
        "tokens",
        "users",
        "people",
        "views",
        "downloads",
        "subscribers",
        "followers",
        "rows",
        "records",
        "requests",
        "customers",
        "visitors",
        "members",
        "copies",
        "words",
        "lines",
    }
)
# Words that follow a name as well as a count ("14B is by the window"): no count follows.
_NOT_COUNTED: Final = frozenset(
    {"is", "was", "are", "were", "will", "would", "has", "had", "can", "and", "or", "but"}
)
_PLACE_WORDS: Final = frozenset(
    {
        "size",
        "seat",
        "gate",
        "row",
        "room",
        "flight",
        "apartment",
        "apt",
        "platform",
        "terminal",
        "suite",
        "unit",
        "bus",
        "route",
        "pier",
        "berth",
        "cabin",
        "exit",
        "bay",
        "stand",
    }
)
# "g" is grams only before "of" or where a phrase ends ("250 g of flour", "add 200g."); else
# it is as often a g-force or a network generation.
_GRAMS_CONTEXT: Final = re.compile(
    r"\s+(?:of|per|a)\b|\s*(?:[.,;:!?)]|$)|[\u4e00-\u9fff]"
    # a conversion ("250g/9oz"; "2g/3g/4g" are networks) or per a unit ("13.5 g/dL", "g/kg")
    r"|\s?/\s?(?:[0-9.]+\s[A-Za-z]|[0-9.]+(?!g\b)[A-Za-z]|(?:dL|L|mL|ml|kg|km|day|serving)\b)"
)
# "10^3 kg": a number with an exponent takes the unit too (the exponent is not the unit's
# number: a match never starts right after "^" or "^-").
_UNIT: Final = re.compile(
    rf"(?<!\^)(?<!\^-)(?P<neg>-)?(?P<num>{_NUM})"
    # a scale word between ("150 million km": "million km" was left unread)
    r"(?:\s(?P<scale>thousand|million|billion|trillion)\b)?"
    r"(?:\s?\^\s?(?P<eneg>-)?(?P<exp>[0-9]+))?\s?(?P<unit>"
    + "|".join(re.escape(u) for u in sorted(_UNITS, key=len, reverse=True))
    + r")(?:\^(?P<pow>[23]))?(?![A-Za-z0-9])"
)
# "10^3", "x^2", "10^-3" (superscripts become "^" in _prepare); after _UNIT, which reads
# "m^2" as square meters. The base is read by the rules after it.
_POWER: Final = re.compile(
    r"(?<=[0-9A-Za-z)\u0391-\u03c9])\s?\^\s?(?P<neg>-)?(?P<exp>[0-9]+|[A-Za-z](?![A-Za-z]))"
)
# "9.58s", "0.5s": seconds after a decimal ("5s" or "20s" may be a phone or a decade).
_DECIMAL_SECONDS: Final = re.compile(
    # spaced too, as SI writes it ("19.19 s", "T = 2.0 s"; "... s" before)
    r"(?<![0-9A-Za-z.,])(?P<neg>-)?(?P<num>[0-9]+\.[0-9]+)\s?s(?![A-Za-z0-9])",
    re.ASCII,
)
# "100s of people", "in the 1000s": hundreds, thousands ("10s" and "20s" are decades); after
# what counts time, a duration ("timeout to 100s", "wait 100s").
_ROUND_PLURAL: Final = re.compile(
    r"(?<![0-9A-Za-z.,$€£¥])(?P<n>100|1,?000)s(?![A-Za-z0-9])"  # not a model's ("RX100s")
)
# "wait 10s", "every 30s", "Jog for 90s, walk for 60s", "timer for 45s": seconds after what
# counts time, where the duration ends ("every 90s kid" and "for 90s kids" are decades).
_GLUED_SECONDS: Final = re.compile(r"(?<![0-9A-Za-z.,$€£¥])(?P<n>[0-9]{1,4})s(?![A-Za-z0-9'])")
_FOR_BEFORE: Final = re.compile(r"\b[Ff]or\s+$")
_PHRASE_END: Final = re.compile(r"\s*(?:$|[.,;:!?)\]])")
_DURATION_END: Final = re.compile(
    _PHRASE_END.pattern + r"|\s*(?:and|or|then|to|before|after|between|each|per|of|with|rest|"
    r"later|max|min|apart|intervals?|at)\b"
)
# "2h 30m", "1h55m": hours and minutes (the "m" was meters).
_HOURS_MINUTES: Final = re.compile(
    r"(?<![0-9A-Za-z.])(?P<h>[0-9]{1,2})\s?h\s?(?P<m>[0-9]{1,2})\s?m(?:in)?(?![A-Za-z0-9])"
)
# A video resolution, said in pairs of digits as people do ("1080p": ten eighty P).
_RESOLUTION: Final = re.compile(
    r"(?<![0-9A-Za-z.,])(?P<n>240|360|480|576|720|1080|1440|2160|4320)(?P<s>[pPi])(?![A-Za-z0-9])"
)
_ORDINAL: Final = re.compile(r"(?<![0-9])(?P<n>[0-9]+)(?:st|nd|rd|th)\b", re.IGNORECASE | re.ASCII)
# ("the 1990's", "70's": "one thousand nine hundred ninety s" before)
_DECADE: Final = re.compile(r"(?<![0-9])['’]?(?P<c>1[0-9]|20)?(?P<d>[1-9]0|00)['’]?s\b", re.ASCII)
_YEAR_AFTER: Final = re.compile(
    r"\b(?P<kw>[Ii]n|[Ss]ince|[Bb]y|[Ff]rom|[Uu]ntil|[Tt]ill|[Tt]hrough|to|of|[Cc]irca|"
    r"[Bb]efore|[Aa]fter|[Dd]uring|[Aa]round|[Yy]ear|[Ee]arly|[Ll]ate|[Mm]id|"
    # a quarter, a half or a season of a year ("Q3 2025", "H1 2024", "FY 2023", "spring 2026")
    r"Q[1-4]|H[12]|FY|[Ss]pring|[Ss]ummer|[Aa]utumn|[Ff]all|[Ww]inter|"
    + "|".join(sorted(_MONTH_BY_NAME, key=len, reverse=True))  # "Jan 2020", "Sept. 2023"
    + r")\.?\s+(?P<y>1[1-9][0-9]{2}|20[0-9]{2})(?![0-9]|[.,][0-9]|\s?%)",
    re.ASCII,
)
_YEAR_ZH: Final = re.compile(r"(?<![0-9])(?P<y>[0-9]{4})\s?年")
_FRACTION: Final = re.compile(r"(?<![0-9/.])(?P<a>[0-9]+)/(?P<b>[0-9]+)(?![0-9/])")
# A mixed number ("2 1/2 hours", "1-1/2 inches", "1½ cups") or a fraction before a unit
# ("1/2 tsp"): "two and a half hours", "half a teaspoon" (the unit rule took "2 tsp" out of
# "1/2 tsp", and a mixed number lost its "and"). Proper fractions up to twentieths only.
_MIXED_FRACTION: Final = re.compile(
    r"(?<![0-9./])(?<![0-9],)(?:(?P<w>[0-9]+)[ -])?(?P<a>[0-9]+)/(?P<b>[0-9]+)(?![0-9/])"
    r"(?:\s?(?P<unit>"
    + "|".join(re.escape(u) for u in sorted(_UNITS, key=len, reverse=True))
    + r")(?![A-Za-z0-9]))?"
)
_LEADING_POINT: Final = re.compile(r"(?<![\w.])(?P<neg>-)?\.(?P<frac>[0-9]+)(?![0-9])")
# What "2" is 两 before, not 二: o'clock, measure words, units and 万/千 (not 月, 号 or 楼,
# which name the second one).
_TAKES_LIANG: Final = re.compile(
    # 二次方 (squared), 二次函数/方程, 二元一次方程 and 二年级 (a grade) are terms, not counts
    "次(?!方|函数|方程|幂|曲线)|元(?![一二三]次|方程|函数)|年(?!级)|"
    "点|个|小时|天|位|种|周|星期|岁|倍|本|只|张|件|名|条|台|辆|分钟|秒|万|千|亿|杯|斤|公斤|"
    "公里|米|遍|场|家|座|门|节|页|份|双|对|人|块|句|部|篇|首|碗|瓶|间|层|把|根|头|片|"
    "升|毫升|克|颗|粒|支|盒|包|袋|箱|项|趟|棵|套(?!房)|厅|室|卫"
)
_NUMBER: Final = re.compile(rf"(?P<neg>-)?(?P<int>{_INT})(?:\.(?P<frac>[0-9]+))?")
_SYMBOL: Final = re.compile("|".join(re.escape(s) for s in sorted(_SYMBOLS, key=len, reverse=True)))
# Not after a lone capital: "S/M/L/XL" are sizes ("S M per liter slash XL" before).
_PER_SLASH: Final = re.compile(
    r"(?<![^A-Za-z][A-Z])(?<!^[A-Z])\s?/\s?"
    r"(?:(?P<w>" + "|".join(sorted(_PER_WORDS, key=len, reverse=True)) + r")\b"
    r"|(?=[天日时月年周人次个件斤晚小公分克升位张间瓶杯份包盒箱桶台辆秒米千毫吨平立度]))",
    re.ASCII,
)
_AND_OR: Final = re.compile(r"\band/or\b", re.ASCII)
# "A/B testing", "CI/CD", "TCP/IP", "I/O": a slash between two acronyms is not said.
_ACRONYM_PAIR: Final = re.compile(
    r"(?<![A-Za-z0-9/])(?P<a>[A-Z]{1,5})/(?P<b>[A-Z]{1,5})(?![A-Za-z0-9/])", re.ASCII
)
_APOSTROPHE: Final = re.compile(r"(?<=[A-Za-z])['’](?=[A-Za-z])")
# Both start a match only where a run of their characters starts: from every position inside
# a long run with no dash (or stop) in it, the greedy run backtracked all the way: quadratic,
# 1.6 s for a 1000-character say (NFKD expands U+FDFA into 18 characters, most of them spaces),
# with the GIL held off the loop all the while (found by review). The matches are the same.
_SPACED_DASH: Final = re.compile(r"(?<![ \t])[ \t]+-+[ \t]+|(?:(?<![ \t])[ \t]+)?[—–]+[ \t]*")
_PUNCT_RUN: Final = re.compile(r"(?<![\s，。、,.])[\s，。、,.]*[，。、,.][\s，。、,.]*")
_CJK_SPACE: Final = re.compile(r"(?<=[\u4e00-\u9fff])\s+(?=[\u4e00-\u9fff])")
_STOP_FOLLOWS: Final = re.compile(r"\s*(?:$|\n)|\s+[A-Z\u4e00-\u9fff]")


def _translation(stops: str, stop: str, commas: str, comma: str) -> dict[int, str]:
    return {**{ord(c): stop for c in stops}, **{ord(c): comma for c in commas}}


# Marks ChatTTS would drop, mapped onto the pause it keeps: a sentence stop or a comma.
_EN_PUNCTUATION: Final = _translation("!?;！？；…\n", ".", ":：()[]{}（）【】", ",")
_ZH_PUNCTUATION: Final = _translation("!?;.！？；…\n", "。", ",:：()[]{}（）【】", "，")


# ------------------------------------------------------------------------ rule helpers


def _sp(words: str, zh: bool) -> str:
    """Pad English words with spaces so they never glue onto neighbours ("GPT4o")."""
    return words if zh else f" {words} "


def _stop_if_sentence_ends(m: re.Match[str]) -> str:
    """A "." that a rule swallowed ("p.m.", "etc.") may also have ended the sentence."""
    return "." if m.group(0).endswith(".") and _STOP_FOLLOWS.match(m.string, m.end()) else ""


def _negative(m: re.Match[str]) -> bool:
    """A "-" is a minus sign only where it cannot be a hyphen ("COVID-19", "GPT-4").

    Chinese puts no space before a minus sign: after a CJK ideograph it is one ("气温-5度").
    """
    if not m.group("neg"):
        return False
    start = m.start()
    if start == 0:
        return True
    before = m.string[start - 1]
    return not before.isalnum() or _CJK.match(before) is not None


def _signed(m: re.Match[str], words: str, zh: bool) -> str:
    if _negative(m):
        return ("负" if zh else "minus ") + words
    return (" " if m.group("neg") else "") + words


def _split_num(number: str) -> tuple[str, str | None]:
    int_part, _, frac = number.partition(".")
    return int_part, frac or None


# ------------------------------------------------------------------------ rules


def _url(m: re.Match[str], zh: bool) -> str:
    host, tail = _url_host(m.group(0))
    return _sp(_read_domain(host, zh), zh) + tail


def _url_host(url: str) -> tuple[str, str]:
    """The part of a URL that is read (its host, without "www."), and the punctuation after
    it that ends the sentence, not the URL ("see x.com.")."""
    trailing = len(url) - len(url.rstrip(".,;:!?)]}'\""))
    tail = url[len(url) - trailing :] if trailing else ""
    host = re.sub(r"^(?:https?://)?(?:www\.)?", "", url[: len(url) - trailing], flags=re.I)
    return re.split(r"[/?#:]", host, maxsplit=1)[0], tail


def _read_domain(host: str, zh: bool) -> str:
    dot = "点" if zh else " dot "
    return dot.join(part.replace("-", " ") for part in host.split(".") if part)


def _email(m: re.Match[str], zh: bool) -> str:
    user, _, domain = m.group(0).partition("@")
    user = re.sub(r"[._%+-]+", " ", user)
    return _sp(f"{user} at {_read_domain(domain, zh)}", zh)


def _domain(m: re.Match[str], zh: bool) -> str:
    path = m.group(0)[len(m["domain"]) :]
    stop = "." if path.endswith(".") and _STOP_FOLLOWS.match(m.string, m.end()) else ""
    return _sp(_read_domain(m["domain"], zh), zh) + stop


# Titles said in full only before a name: "Col. 3" is a column, "Gen. 2" a generation.
_TITLES: Final = frozenset({"Gov.", "Sen.", "Rep.", "Gen.", "Lt.", "Capt.", "Col.", "Sgt."})
_COLOUR_AFTER: Final = re.compile(
    r"\s*(?:Blue|Gr[ae]y|Green|Pink|Purple|Brown|Yellow|Red|Orange|Tan|Beige|Olive|Teal)\b"
)
_NAME_AFTER: Final = re.compile(r"\s*[A-Z][a-z]")  # "Gen. Z" is a generation too


def _abbreviation(m: re.Match[str], zh: bool) -> str:
    abbreviation = _ABBREVIATION_FORMS[m.group(0)]
    if abbreviation in _TITLES and not _NAME_AFTER.match(m.string, m.end()):
        return m.group(0)
    if abbreviation == "Lt." and _COLOUR_AFTER.match(m.string, m.end()):
        return "Light"  # a shop's "Lt. Blue"
    en, chinese = _ABBREVIATIONS[abbreviation]
    # Only "etc." ends sentences; "Mr. Smith" must not get a pause after "Mister".
    stop = _stop_if_sentence_ends(m) if abbreviation == "etc." else ""
    return _sp(chinese if zh else en, zh) + stop


# A dotted name is prose with a missing space when what follows the dot is such a word
# ("fine.so we left", "Tap OK.then"), and an abbreviation without its last dot ("e.g,").
# fmt: off
_PROSE_AFTER_DOT: Final = frozenset((
    "so", "then", "the", "and", "but", "we", "i", "it", "you", "he", "she", "they", "this",
    "that", "there", "ltd", "inc", "also", "now", "if", "or", "a", "an", "in", "on", "at", "to",
    "my", "our", "your", "not", "no", "yes", "ok", "thanks", "please",
))
# fmt: on
_LAST_DOT_MISSING: Final = MappingProxyType(
    {"e.g": ("for example", "例如"), "i.e": ("that is", "也就是")}
)


def _dotted_name(m: re.Match[str], zh: bool) -> str:
    name = m.group(0)
    abbreviation = _LAST_DOT_MISSING.get(name.lower())
    if abbreviation is not None:
        return _sp(abbreviation[1] if zh else abbreviation[0], zh)
    if name.split(".")[1].lower() in _PROSE_AFTER_DOT:
        return name.replace(".", ". ")
    return _sp(name.replace(".", "点" if zh else " dot "), zh)


def _page(m: re.Match[str], zh: bool) -> str:
    return "第" if zh else "page "


def _service_number(m: re.Match[str], zh: bool) -> str:
    return _sp(_digits(m["n"] or m["m"], zh), zh)


def _acronym(m: re.Match[str], zh: bool) -> str:
    letters = " ".join(m.group(0).replace(".", ""))
    return _sp(letters, zh) + _stop_if_sentence_ends(m)


def _date_words(year: int | None, month: int, day: int, zh: bool) -> str:
    if zh:
        head = f"{_digits(str(year), True)}年" if year is not None else ""
        return f"{head}{read_int_zh(month)}月{read_int_zh(day)}日"
    words = f"{_MONTHS[month - 1]} {_ordinal_en(read_int_en(day))}"
    return words + (f", {read_year_en(year)}" if year is not None else "")


def _iso_date(m: re.Match[str], zh: bool) -> str:
    return _sp(_date_words(int(m["y"]), int(m["m"]), int(m["d"]), zh), zh)


def _date_year_last(m: re.Match[str], zh: bool) -> str:
    first, second = int(m["a"]), int(m["b"])
    if first > 12 and second > 12:
        return m.group(0)  # no month: left to the rules for numbers
    month_first = second > 12 or (first <= 12 and m["sep"] == "/")
    month, day = (first, second) if month_first else (second, first)
    return _sp(_date_words(int(m["y"]), month, day, zh), zh)


def _month_day(m: re.Match[str], zh: bool) -> str:
    year = int(m["y"]) if m["y"] else None
    month = _MONTH_BY_NAME[m["month"]]
    if m["d2"] is None:
        return _sp(_date_words(year, month, int(m["d"]), zh), zh)
    last = int(m["d2"])
    if zh:
        return _date_words(year, month, int(m["d"]), zh) + f"至{read_int_zh(last)}日"
    words = f"{_date_words(None, month, int(m['d']), zh)} to {_ordinal_en(read_int_en(last))}"
    return _sp(words + (f", {read_year_en(year)}" if year is not None else ""), zh)


def _clock_words(hour: int, minute: int, second: int | None, ampm: str | None, zh: bool) -> str:
    if zh:
        prefix = {"a": "上午", "p": "下午"}.get((ampm or "").lower(), "")
        words = prefix + ("两" if hour == 2 else read_int_zh(hour)) + "点"
        if minute:
            words += ("零" if minute < 10 else "") + read_int_zh(minute) + "分"
        if second:
            words += read_int_zh(second) + "秒"
        return words
    words = read_int_en(hour)
    if minute:
        words += (" oh " if minute < 10 else " ") + read_int_en(minute)
    elif not ampm:
        words += " hundred" if hour > 12 or hour == 0 else " o clock"
    if second:
        words += f" and {read_int_en(second)} seconds"
    if ampm:
        words += " A M" if ampm.lower() == "a" else " P M"
    return words


def _clock(m: re.Match[str], zh: bool) -> str:
    hour, minute = int(m["h"]), int(m["m"])
    if hour > 24 or (m["ampm"] and not 1 <= hour <= 12):
        return m.group(0)  # not a time of day; the ratio rule reads it
    second = int(m["s"]) if m["s"] else None
    words = _clock_words(hour, minute, second, m["ampm"], zh)
    return _sp(words, zh) + (_stop_if_sentence_ends(m) if m["ampm"] else "")


def _time_end(text: str) -> tuple[int, int, int | None, str | None] | None:
    """(hour, minute, second, am/pm) of one end of a time range; None for a bare number."""
    if (m := _CLOCK.fullmatch(text)) is not None:
        return int(m["h"]), int(m["m"]), int(m["s"]) if m["s"] else None, m["ampm"]
    if (m := _HOUR_AMPM.fullmatch(text)) is not None:
        return int(m["h"]), 0, None, m["ampm"]
    return None


def _time_range(m: re.Match[str], zh: bool) -> str:
    ends = [(_time_end(m[key]), m[key]) for key in ("a", "b")]
    if all(end is None for end, _ in ends):
        return m.group(0)  # "3-4 hours": a range of numbers, read by the range rule
    words: list[str] = []
    for end, raw in ends:
        if end is None:  # a bare hour next to a time: "9-5pm"
            words.append(read_int_zh(int(raw)) if zh else read_int_en(int(raw)))
            continue
        hour, minute, second, ampm = end
        if hour > 24 or (ampm and not 1 <= hour <= 12):
            return m.group(0)  # not times of day ("25:61"): the rules below read them
        words.append(_clock_words(hour, minute, second, ampm, zh))
    if zh:
        return "到".join(words)
    return _sp(" to ".join(words), zh) + _stop_if_sentence_ends(m)


def _dotted_clock(m: re.Match[str], zh: bool) -> str:
    words = _clock_words(int(m["h"]), int(m["m"]), None, m["ampm"], zh)
    return _sp(words, zh) + _stop_if_sentence_ends(m)


def _hour_ampm(m: re.Match[str], zh: bool) -> str:
    hour = int(m["h"])
    if not 1 <= hour <= 12:
        return m.group(0)
    return _sp(_clock_words(hour, 0, None, m["ampm"], zh), zh) + _stop_if_sentence_ends(m)


def _ratio(m: re.Match[str], zh: bool) -> str:
    a, b = _read_number(*_split_num(m["a"]), zh), _read_number(*_split_num(m["b"]), zh)
    if zh:
        return f"{a}比{b}"
    return _sp(f"{a} to {b}", zh)


def _groups(parts: list[str], zh: bool) -> str:
    """Read groups of a number (already read) with a pause between them, as one says a
    phone number."""
    return _sp(("，" if zh else ", ").join(parts), zh)


def _phone(m: re.Match[str], zh: bool) -> str:
    parts = [_digits(g, zh) for g in (m["area"] or m["area2"], m["a"], m["b"]) if g]
    if m["cc"]:
        cc = m["cc"].strip(" -+")
        parts.insert(0, ("加" if zh else "plus ") + _digits(cc, zh))
    return _groups(parts, zh)


def _local_phone(m: re.Match[str], zh: bool) -> str:
    return m["cue"] + _groups([_digits(m["a"], zh), _digits(m["b"], zh)], zh)


def _digit_groups(m: re.Match[str], zh: bool) -> str:
    groups = m.group(0).split("-")
    if len(groups) == 3 and all(len(g) <= 2 and (g == "0" or g[0] != "0") for g in groups):
        # a win-loss-tie record ("10-6-1": ten, six, one; "one zero, six, one" before)
        return _groups([_read_number(g, None, zh) for g in groups], zh)
    return _groups([_digits(group, zh) for group in groups], zh)


def _dotted(m: re.Match[str], zh: bool) -> str:
    dot = "点" if zh else " dot "
    return _sp(dot.join(_read_number(p, None, zh) for p in m.group(0).split(".")), zh)


def _year_range(m: re.Match[str], zh: bool) -> str:
    short = len(m["b"]) == 2  # "2023-24": to 2024, said "to twenty four"
    end = m["a"][:2] + m["b"] if short else m["b"]
    if short and int(end) <= int(m["a"]):
        return m.group(0)  # "2019-10": no range of years (a month, a code): the rules below
    if zh:  # Chinese years are read digit by digit: 二零二零到二零二四
        return f"{_digits(m['a'], zh)}到{_digits(end, zh)}"
    last = read_int_en(int(m["b"])) if short else read_year_en(int(end))
    return _sp(f"{read_year_en(int(m['a']))} to {last}", zh)


def _is_model_number(before: str, text: str, after: int) -> bool:
    """A letter-glued number and the number after its dash name a model when either has
    three digits or more ("i7-12700", "RTX3080-10G", "MP3-320"); "rows B2-5" is a range."""
    digits_after = _DIGITS_AT.match(text, after)
    longest = max(len(before) - 1, len(digits_after.group(0)) if digits_after else 0)
    return longest >= 3


# A score in Chinese: a dash between two numbers before a word of winning or losing, or after
# 比分 ("曼城4-0大胜": 四比零, not 四到零).
_SCORE_AFTER_ZH: Final = re.compile(
    r"[0-9]+\s?(?:大胜|险胜|获胜|取胜|战胜|击败|胜出|胜|负于|告负|落败|败|输|赢|逆转|战平|打平|平局|的比分)"
)
_SCORE_BEFORE_ZH: Final = re.compile(r"(?:比分|比分为|比分是|以|最终)\s?[0-9]+$")


def _range(m: re.Match[str], zh: bool) -> str:
    if (
        zh
        and m.group(0) in "-–"
        and (_SCORE_AFTER_ZH.match(m.string, m.end()) or _before(_SCORE_BEFORE_ZH, m))
    ):
        return "比"
    glued = None
    if m.group(0) in "-–":
        glued = _GLUED_NUMBER_BEFORE.search(m.string, max(0, m.start() - _LOOK_BACK), m.start())
    if glued and _is_model_number(glued.group(0), m.string, m.end()):
        return m.group(0)  # a model name ("i7-12700", "RTX3080-10G"): a hyphen, not "to"
    return "到" if zh else " to "


def _unit_range(m: re.Match[str], zh: bool) -> str:
    return m["unit"] + _range(m, zh)


# "6 mos-2 yrs", "3 months-1 year": a range between two lengths of time.
_TIME_UNIT_RANGE: Final = re.compile(
    r"(?<=[0-9])(?P<u>\s?(?:mos?|yrs?|wks?|hrs?|mins?|months?|years?|weeks?|days?|hours?|"
    r"minutes?)|个月|岁|周|天|小时|分钟)[-–](?=[0-9])"  # "宝宝6个月-2岁"
)


def _time_unit_range(m: re.Match[str], zh: bool) -> str:
    return m["u"] + ("到" if zh else " to ")


def _minus_op(m: re.Match[str], zh: bool) -> str:
    return "减" if zh else " minus "


# What follows "2x4" when it is a product, not a size: "3x4 = 12", "3x4 is 12".
_PRODUCT_AFTER: Final = re.compile(
    r"[0-9.,]*\s?(?:=|(?:is|equals|makes|gives|plus|minus|times|divided)\b|[?+*/-])"
    # "Is 8x8 64?"; not a list ("640x480, 800x600")
    r"|[0-9.,]*[0-9]\s+[0-9]",
    re.ASCII,
)


# What ends a run of spaced "x"s that is a size: a length ("12 x 10 x 6 inches").
_SIZE_AFTER: Final = re.compile(
    # (three sides at most: a run to the end of a long chain from every "x" was quadratic)
    r"[0-9.,]{1,20}(?:\s?[xX×]\s?[0-9.,]{1,20}){0,2}(?:\s?(?:inches|inch|cm|mm|ft|feet|foot|meters|metres|"
    # glued "in" before its noun ("24in tile"); spaced only where the phrase ends ("8.5 x 11
    # in.": "2 x 3 in NumPy" is a product)
    r"px|pixels?)(?![A-Za-z])|in\b(?!\s+[a-z])|\s+in(?![A-Za-z0-9])(?!\s*[A-Za-z0-9])|[\"”′″])"
    # (and not a product of lengths: "4 x 5 cm = 20 cm")
    r"(?!\s*(?:=|(?:is|equals|makes|gives)\b))",
)


# "Calculate 3x4", "what is 3x4": a product asked for.
_ASKED_PRODUCT: Final = re.compile(
    r"\b(?:[Cc]alculate|[Cc]ompute|[Ww]hat is|[Ww]hat's|[Ss]olve|[Ee]valuate|[Mm]ultiply)"
    r"\s+[0-9.,]*$"
)


def _name_op(m: re.Match[str], zh: bool) -> str:
    text = m.string
    if _WORD_AFTER_NUMBER.match(text, m.end()):
        return m.group(0)  # "part a - 3 points", "Setup(s) - 2 steps": a label's dash
    if text[m.start() - 1] == ")" and not _before(_CALL_BEFORE, m):
        return m.group(0)
    if m["op"] == "-":
        return "减" if zh else " minus "
    return "乘" if zh else " times "


def _times_op(m: re.Match[str], zh: bool) -> str:
    if zh:
        return "乘"
    # Glued with an "x", it is a size ("1920x1080", "2x4 lumber", "a 3x3 grid") unless
    # arithmetic follows: said "by", as sizes are. Spaced, it is a size when a length ends
    # the run ("12 x 10 x 6 inches", "1920 x 1080 pixels"; "times" before).
    x = m.group(0).strip() in ("x", "X", "×")
    text = m.string
    product = _PRODUCT_AFTER.match(text, m.end()) or _before(_ASKED_PRODUCT, m)
    sized = m.group(0) in ("x", "X") or _SIZE_AFTER.match(text, m.end())
    return " by " if x and sized and not product else " times "


def _size_by(m: re.Match[str], zh: bool) -> str:
    return m["unit"] + ("乘" if zh else " by ")


def _factor(m: re.Match[str], zh: bool) -> str:
    return m["num"] + ("倍" if zh else " times ")


def _approx(m: re.Match[str], zh: bool) -> str:
    return "大约" if zh else " about "


# A verb before a comparison says its "is" already ("must be < 10": must be less than ten).
_VERB_BEFORE: Final = re.compile(
    r"\b(?:is|are|was|were|be|been|being|stays|remains|isn't|aren't)\s*$", re.IGNORECASE
)
# "Settings > Privacy > Location", "go to Settings > Privacy": a menu path, no comparison;
# a single step between capitalised words with no such verb is one ("Revenue > Costs").
_MENU_BEFORE: Final = re.compile(
    r"(?:\b[A-Z][A-Za-z]+\s+>\s+|\b(?:[Gg]o to|[Oo]pen|[Nn]avigate to|[Cc]lick|[Ss]elect|"
    r"[Cc]hoose|[Tt]ap|[Uu]nder|[Hh]ead to|[Ii]n)\s+)[A-Z][A-Za-z]+\s+$"
)
_MENU_AFTER: Final = re.compile(r"\s+[A-Z][A-Za-z]+\b")
_MENU_CHAIN_AFTER: Final = re.compile(r"\s+[A-Z][A-Za-z]+\s+>\s+[A-Z]")
_MENU_STEP_BEFORE: Final = re.compile(r"\b[A-Z][A-Za-z]+\s+$")
_MENU_STEP_ZH: Final = re.compile(r"\s*[\u4e00-\u9fff]")
_CJK_BEFORE: Final = re.compile(r"[\u4e00-\u9fff]\s*$")


def _comparison_words(m: re.Match[str], en: str) -> str:
    """``en`` ("is less than") without its "is" after a verb that says it."""
    if en.startswith("is ") and _before(_VERB_BEFORE, m):
        return en.removeprefix("is ")
    return en


def _compare(m: re.Match[str], zh: bool) -> str:
    op = m["op"]
    text = m.string
    if (
        zh
        and op == ">"
        and _MENU_STEP_ZH.match(text, m.end())
        and _CJK_BEFORE.search(text, max(0, m.start() - 2), m.start())
    ):
        return "，"  # "打开设置 > 隐私 > 定位服务"
    if op == ">" and _MENU_AFTER.match(text, m.end()):
        window = max(0, m.start() - 2 * _LOOK_BACK)
        if _MENU_BEFORE.search(text, window, m.start()) or (
            _MENU_CHAIN_AFTER.match(text, m.end())
            and _MENU_STEP_BEFORE.search(text, window, m.start())
        ):
            return ", "
    words = {
        "<": ("is less than", "小于"),
        ">": ("is greater than", "大于"),
        "<=": ("is at most", "小于等于"),
        ">=": ("is at least", "大于等于"),
    }[op]
    return _sp(words[1] if zh else _comparison_words(m, words[0]), zh)


def _hash_number(m: re.Match[str], zh: bool) -> str:
    if zh:
        return _int_words(m["n"], zh) + "号"
    return _sp("number " + _read_number(m["n"], None, zh), zh)


def _money(m: re.Match[str], zh: bool) -> str:
    cur = _CURRENCIES[m["sym"]]
    int_part, frac = _split_num(m["num"])
    scale_key = (m["scale"] or (m.groupdict().get("abbr") or "")).lower()
    scale = _SCALE_WORDS.get(scale_key)
    if zh and m.string.startswith((cur.zh, cur.zh[-1]), m.end()):
        cur = replace(cur, zh="")  # "¥3.5万元", "$5美元": the text says its unit itself
    if zh and scale:
        words = _read_scaled(int_part, frac, scale_key, zh) + cur.zh
    elif zh:
        frac = frac.rstrip("0") if frac else None  # 5.50元 is said 五点五元
        words = _read_number(int_part, frac or None, zh) + cur.zh
    elif scale:
        words = f"{_read_scaled(int_part, frac, scale_key, zh)} {cur.many}"
    else:
        words = _money_en(int_part, frac, cur)
    return _sp(_signed(m, words, zh), zh)


# A change from one amount to another: "rose $2B to $50B" is no range of 2 to 50 billion.
_CHANGE_BEFORE: Final = re.compile(
    r"\b(?:rose|rise|rises|rising|fell|fall|falls|grew|grow|grows|dropped|drop|drops|jumped|"
    r"jump|climbed|climb|increased|increase|decreased|decrease|declined|decline|gained|gain|"
    r"lost|lose|slipped|surged|soared|plunged|cut|raised|lowered|reduced\s+by|up|down|by)\s+$",
    re.IGNORECASE,
)


def _money_range(m: re.Match[str], zh: bool) -> str:
    cur = _CURRENCIES[m["sym"]]
    if not zh and " to " in m.group(0) and _before(_CHANGE_BEFORE, m):
        # each amount whole ("rose two billion dollars to fifty billion dollars")
        ends = []
        for number, scale in ((m["a"], m["ascale"]), (m["b"], m["bscale"])):
            int_part, frac = _split_num(number)
            key = (scale or "").strip().lower()
            ends.append(
                f"{_read_scaled(int_part, frac, key, zh)} {cur.many}"
                if key
                else _money_en(int_part, frac, cur)
            )
        return _sp(" to ".join(ends), zh)
    a, b = _split_num(m["a"]), _split_num(m["b"])
    b_scale = (m["bscale"] or "").strip().lower()
    a_scale = (m["ascale"] or "").strip().lower() or b_scale  # "$1.5-2M": both in millions
    if zh:
        ends = [
            _read_scaled(*end, scale, zh) if scale else _read_number(*end, zh)
            for end, scale in ((a, a_scale), (b, b_scale))
        ]
        return f"{ends[0]}到{ends[1]}{cur.zh}"
    if not a_scale and not b_scale:
        if any(frac is not None and len(frac) == 2 for _, frac in (a, b)):  # with cents
            return _sp(f"{_money_en(*a, cur)} to {_money_en(*b, cur)}", zh)
        return _sp(f"{_read_number(*a, zh)} to {_read_number(*b, zh)} {cur.many}", zh)
    if a_scale == b_scale:
        words = f"{_read_number(*a, zh)} to {_read_scaled(*b, b_scale, zh)}"
    else:
        first = _read_scaled(*a, a_scale, zh) if a_scale else _read_number(*a, zh)
        words = f"{first} to {_read_scaled(*b, b_scale, zh)}"
    return _sp(f"{words} {cur.many}", zh)


def _money_en(int_part: str, frac: str | None, cur: _Currency) -> str:
    if len(int_part.replace(",", "")) > _MAX_CARDINAL_DIGITS:  # a code, read digit by digit
        return f"{_read_number(int_part, frac, False)} {cur.many}"
    amount = int(int_part.replace(",", ""))
    if frac and len(frac) == 2 and cur.sub_one and cur.sub_many:
        cents = int(frac)
        main = f"{read_int_en(amount)} {cur.one if amount == 1 else cur.many}"
        if not cents:
            return main
        sub = f"{read_int_en(cents)} {cur.sub_one if cents == 1 else cur.sub_many}"
        return f"{main} and {sub}" if amount else sub
    unit = cur.one if amount == 1 and not frac else cur.many
    return f"{_read_number(int_part, frac, False)} {unit}"


def _percent(m: re.Match[str], zh: bool) -> str:
    int_part, frac = _split_num(m["num"])
    number = _read_number(int_part, frac, zh)
    if zh:
        return _signed(m, "百分之" + number, zh)
    return _sp(_signed(m, number + " percent", zh), zh)


def _scaled_number(m: re.Match[str], zh: bool) -> str:
    int_part, frac = _split_num(m["num"])
    abbr = m["abbr"].lower()
    if abbr == "t" or (len(int_part) == 1 and not frac and abbr not in ("mn", "bn")):
        # "T" counts only what it counts in earnest ("15T tokens"): "a 20T truck" is tonnes.
        after = _WORD_AFTER_SCALE.match(m.string, m.end())
        if after is None or after["word"] not in _COUNTED_BY_ONE_DIGIT:
            return m.group(0)  # "3M", "4K", "2B", "20T": a name, said as written
    if not (frac or abbr in ("mn", "bn") or _counts_something(m, int_part, abbr)):
        return m.group(0)  # a seat, a gate, a chip, a 401k: said as written
    words = _read_scaled(int_part, frac, abbr, zh)
    return _sp(_signed(m, words, zh), zh)


def _counts_something(m: re.Match[str], int_part: str, abbr: str) -> bool:
    """Whether a whole number glued to a scale letter is an amount: it counts the word
    after it ("10M users", "15k stars", 10M用户), unless that is a karat or a race ("18K
    gold", "a 10K run"), the word before names a place ("seat 14B", "Gate 22B"), or it is a
    retirement plan ("401k") or a chip ("14900K")."""
    text, start, end = m.string, m.start(), m.end()
    after = _WORD_AFTER_SCALE.match(text, end)
    if after is None:
        return False
    if after["word"] in _NOT_COUNTED:
        return False
    if abbr == "k" and after["word"] in ("gold", "karat", "carat", "run", "race"):
        return False
    if int_part in ("401", "403", "457") or (abbr == "k" and len(int_part) >= 4):
        return False
    before = _WORD_BEFORE.search(text, max(0, start - _LOOK_BACK), start)
    return before is None or before["word"].lower() not in _PLACE_WORDS


def _read_scaled(int_part: str, frac: str | None, scale_key: str, zh: bool) -> str:
    """ "2.5 million" in English; in Chinese the whole amount ("10M" is 一千万, 2.5B 二十五亿),
    as Chinese counts in 万 and 亿, where "十百万" is no one's reading; and 万 or 亿 in
    English as its amount too ("3.5万" is thirty five thousand)."""
    english, chinese = _SCALE_WORDS[scale_key]
    if not zh and " " not in english:  # a Chinese unit (万, 亿) is said as its amount
        return f"{_read_number(int_part, frac, zh)} {english}"
    amount = Decimal(f"{int_part.replace(',', '')}.{frac or 0}") * _SCALE_VALUES[english]
    whole, _, fraction = format(amount.normalize(), "f").partition(".")
    if len(whole) > _MAX_CARDINAL_DIGITS:
        # Past what is said as an amount: as written.
        return _read_number(int_part, frac, zh) + (chinese if zh else f" {english}")
    return _read_number(whole, fraction or None, zh)


# A glued "W" is watts beside what has power ("a 100W bulb", "charges at 65W", "rated
# 5W"): "apartment 4W", "Suite 200W" and "122.4W" (a longitude) are names and places.
_POWER_AFTER: Final = re.compile(
    r"[\s-]+(?:bulbs?|LEDs?|led|chargers?|charging|adapters?|power|output|laser|speakers?|amps?|"
    r"amplifiers?|motors?|heaters?|panels?|solar|lights?|lamps?|supply|PSU|max|RMS|peak|"
    r"fast|USB|wireless|MagSafe|each|per|or|to|total|TDP|of\s+(?:power|output|heat))\b"
)
_POWER_BEFORE: Final = re.compile(
    r"(?:power|draws?|consumes?|consumption|output|charg\w*|rated|bulb|supply|TDP|uses|"
    r"wattage)(?:\W+(?:is|are|at|up to|of|about|only))?\W+"
    # "draws 20W to 65W": the range's first wattage between
    r"(?:[0-9.]+\s?W?(?:\s*(?:to|or|-|–|/)\s*|\W+))?$",
    re.IGNORECASE,
)


def _is_power(m: re.Match[str]) -> bool:
    text = m.string
    return bool(_POWER_AFTER.match(text, m.end()) or _before(_POWER_BEFORE, m, "num"))


def _unit(m: re.Match[str], zh: bool) -> str:
    if m["unit"] == "g" and not _GRAMS_CONTEXT.match(m.string, m.end()):
        return m.group(0)  # "9 g in the turn", "the 5g network": no grams, said as written
    if m["unit"] in _GLUED_ONLY_UNITS and (
        m.string[m.start("unit") - 1].isspace()
        or _before(_ROAD_BEFORE, m, "num")
        or (m["unit"] == "W" and not _is_power(m))
    ):
        return m.group(0)
    int_part, frac = _split_num(m["num"])
    singular, plural, chinese = _UNITS[m["unit"]]
    number = _read_number(int_part, frac, zh)
    if m["scale"]:
        number = _read_scaled(int_part, frac, m["scale"], zh) if zh else f"{number} {m['scale']}"
    if m["exp"]:  # "10^3 kg": ten cubed kilograms
        number = (number + _power_words(m["exp"], bool(m["eneg"]), zh)).strip()
    power = m["pow"]
    if zh:
        if power and "每" in chinese:  # "9.8m/s²": 米每二次方秒, not 平方米每秒
            head, _, tail = chinese.partition("每")
            chinese = f"{head}每{'二' if power == '2' else '三'}次方{tail}"
        elif power:
            chinese = ("平方" if power == "2" else "立方") + chinese
        elif (
            number == "二"
            and not (m["exp"] or m["neg"])
            and "度" not in chinese
            and "每" not in chinese
        ):
            number = "两"  # 2kg is 两公斤, as 2公斤 is
        return _signed(m, number + chinese, zh)
    one = int_part == "1" and not frac and not _negative(m) and not m["exp"] and not m["scale"]
    # "a 10 min walk", "a 100W bulb": a measure before its noun is singular
    # (not after "per": "L/100km on the highway" is per one hundred kilometers)
    attributive = (
        _before(_ARTICLE_BEFORE, m)
        and not _before(_PER_BEFORE, m)
        and _NOUN_AFTER.match(m.string, m.end())
    )
    unit = singular if one or attributive else plural
    if power and m["unit"] in _LENGTH_UNITS:
        unit = ("square " if power == "2" else "cubic ") + unit
    elif power:  # "m/s^2": meters per second squared
        unit += " squared" if power == "2" else " cubed"
    return _sp(_signed(m, f"{number} {unit}", zh), zh)


def _power(m: re.Match[str], zh: bool) -> str:
    return _power_words(m["exp"], bool(m["neg"]), zh)


def _power_words(exp: str, neg: bool, zh: bool) -> str:
    if not neg and exp in ("2", "3"):
        if zh:
            return "的平方" if exp == "2" else "的立方"
        return " squared " if exp == "2" else " cubed "
    if exp.isdigit():
        exp = _read_number(exp, None, zh)
    if zh:
        return f"的{'负' if neg else ''}{exp}次方"
    return f" to the power of {'minus ' if neg else ''}{exp} "


def _decimal_seconds(m: re.Match[str], zh: bool) -> str:
    int_part, frac = _split_num(m["num"])
    words = _read_number(int_part, frac, zh) + ("秒" if zh else " seconds")
    return _sp(_signed(m, words, zh), zh)


def _glued_seconds(m: re.Match[str], zh: bool) -> str:
    if zh:
        return m.group(0)
    text = m.string
    if _before(_WAIT_BEFORE, m):
        ends = _DURATION_END.match(text, m.end()) is not None
    else:  # after a plain "for", only where the phrase ends ("for 20s and 30s professionals")
        ends = _before(_FOR_BEFORE, m) and _PHRASE_END.match(text, m.end()) is not None
    if not ends:
        return m.group(0)
    return _sp(f"{read_int_en(int(m['n']))} seconds", zh)


def _hours_minutes(m: re.Match[str], zh: bool) -> str:
    hours, minutes = int(m["h"]), int(m["m"])
    if zh:
        return f"{read_int_zh(hours)}小时{read_int_zh(minutes)}分钟"
    hour_word = "hour" if hours == 1 else "hours"
    minute_word = "minute" if minutes == 1 else "minutes"
    return _sp(f"{read_int_en(hours)} {hour_word} {read_int_en(minutes)} {minute_word}", zh)


def _round_plural(m: re.Match[str], zh: bool) -> str:
    if zh or (
        not _OF_AFTER.match(m.string, m.end())  # "to 100s of users" counts users
        and (_before(_WAIT_BEFORE, m) or _before(_TO_BEFORE, m))
    ):
        # "timeout to 100s", 超时设置为100s: a duration (Chinese writes 数百 for hundreds)
        seconds = _read_number(m["n"].replace(",", ""), None, zh)
        return seconds + "秒" if zh else _sp(f"{seconds} seconds", zh)
    return " hundreds " if m["n"] == "100" else " thousands "  # "in the 100s", "100s of"


_TO_BEFORE: Final = re.compile(r"\b(?:to|is|of|at|set)\s+$")
_OF_AFTER: Final = re.compile(r"\s+of\b")


def _resolution(m: re.Match[str], zh: bool) -> str:
    letter = m["s"].upper()
    if zh:
        return _digits(m["n"], zh) + letter
    head, tail = divmod(int(m["n"]), 100)
    return f" {read_int_en(head)} {read_int_en(tail)} {letter} "


def _ordinal(m: re.Match[str], zh: bool) -> str:
    n = m["n"]
    if len(n) > _MAX_CARDINAL_DIGITS:
        return _sp(_digits(n, zh), zh)
    if zh:
        return "第" + read_int_zh(int(n))
    return _sp(_ordinal_en(read_int_en(int(n))), zh)


# What a duration follows ("wait 10s", "every 30s", "timeout=20s"), where "10s" is seconds,
# not a decade ("in their 30s", "80s music").
_WAIT_BEFORE: Final = re.compile(
    r"(?:\b(?:wait|waits|waited|waiting|after|within|every|timeout|takes|took|lasts|lasted|"
    # ("set the timeout to 30s", "a delay of 30s": "thirties" before)
    r"delay|interval|sleep|sleeps)\s+(?:for\s+|about\s+|to\s+|of\s+)?|"
    # "for" only after what lasts ("hold for 30s"; "for 90s kids" is a decade)
    r"\b(?:hold|press|run|heat|cook|bake|boil|blend|stir|rest|pause|microwave|steep)\s+for\s+|"
    r"=\s?)$",
    re.IGNORECASE,
)


# "设置为30s", "等待30s", "30s后": seconds in Chinese where time is counted; else a decade
# ("80s的歌", "90s经典老歌").
_SECONDS_BEFORE_ZH: Final = re.compile(
    r"(?:为|等待|等|超时|每|用时|耗时|需要|需|持续|延迟|间隔|约|大约|最多|最少|至少|仅|只)\s?$"
)
_SECONDS_AFTER_ZH: Final = re.compile(r"\s?(?:后|内|以内|左右|钟|之后)")


def _decade(m: re.Match[str], zh: bool) -> str:
    century, decade = m["c"], m["d"]
    if century is None and decade == "00":
        return m.group(0)
    # (English durations, "wait 10s", are _GLUED_SECONDS' before this rule.)
    if (
        zh
        and century is None
        and not m.group(0).startswith("'")
        and (_SECONDS_AFTER_ZH.match(m.string, m.end()) or _before(_SECONDS_BEFORE_ZH, m))
    ):
        return read_int_zh(int(decade)) + "秒"  # "设置为30s", "等待30s", "30s后"
    if zh:
        if century:
            return _digits(century + decade, True) + "年代"
        return read_int_zh(int(decade)) + "年代"
    if century:
        return _sp(_plural_en(read_year_en(int(century + decade))), zh)
    return _sp(_plural_en(read_int_en(int(decade))), zh)


# A year alone in brackets, as a title's or an event's ("The Godfather (1972)", "Brown v.
# Board (1954)"): said as a year ("one thousand nine hundred seventy two" before).
_YEAR_IN_BRACKETS: Final = re.compile(r"(?<=\()(?P<y>1[5-9][0-9]{2}|20[0-9]{2})(?=\))")


def _year_in_brackets(m: re.Match[str], zh: bool) -> str:
    return _digits(m["y"], zh) if zh else _sp(read_year_en(int(m["y"])), zh)


# A case's "v." between two names ("Brown v. Board of Education"): versus (the segmenter
# no longer cuts there either).
_CASE_VERSUS: Final = re.compile(r"(?<=[A-Za-z.)])\s+v\.\s+(?=[A-Z])", re.ASCII)
_CAPITALISED_BEFORE: Final = re.compile(r"\b[A-Z][A-Za-z.'&-]*\)?$")


def _case_versus(m: re.Match[str], zh: bool) -> str:
    if not _before(_CAPITALISED_BEFORE, m):
        return m.group(0)
    return "诉" if zh else " versus "


# A grade, a blood type or a rating with its minus ("a B-", "O- blood", "BBB-"): the "-" was
# dropped as punctuation, a B- heard as a B.
_GRADE_MINUS: Final = re.compile(
    r"(?<![A-Za-z0-9-])(?P<g>[A-DF]|AB|O|AAA|AA|BBB|BB|CCC|CC)-(?![A-Za-z0-9-])"
    r"(?!\s*[0-9])",  # not a range's dash ("A- 3")
    re.ASCII,
)


def _grade_minus(m: re.Match[str], zh: bool) -> str:
    return f"{m['g']}减" if zh else f" {m['g']} minus "


# Per a square or a cubic unit ("75 µg/m³", "1 g/cm³", "3万/㎡"): "slash m cubed" before.
_PER_POWER: Final = re.compile(
    r"\s?/\s?(?P<u>km|cm|mm|m|ft|in)\s?\^\s?(?P<p>[23])(?![0-9])", re.ASCII
)


def _per_power(m: re.Match[str], zh: bool) -> str:
    singular, _, chinese = _UNITS[m["u"]] if m["u"] != "in" else ("inch", "", "英寸")
    if zh:
        return "每" + ("平方" if m["p"] == "2" else "立方") + chinese
    return f" per {'square' if m['p'] == '2' else 'cubic'} {singular} "


# The inch mark after a number ('a 27" monitor', '6-10" of snow'): it was dropped as
# punctuation ("a twenty seven monitor"). Not a closing quote ('he said "I am 27"'): an odd
# number of quote marks before it on its line opened one.
_INCH_MARK: Final = re.compile(r"(?<![0-9.,])(?P<num>[0-9]+(?:\.[0-9]+)?)[\"″](?![A-Za-z0-9\"])")
_QUOTE_MARK: Final = re.compile(r'(?<![0-9])"')  # after a digit, it may be an inch mark
# How far back on its line quote marks are counted (a window: counted from the line's start,
# a long line of sizes was quadratic).
_QUOTE_LOOK_BACK: Final = 200


# A height in feet and inches ("6'8\"", "5′11″"): "six foot eight", as it is said; past 11,
# and in Chinese, minutes and seconds (a pace: 配速5'30": 五分三十秒, "five three thirty
# inches" before).
_HEIGHT: Final = re.compile(
    r"(?<![0-9.,])(?P<f>[1-9])['′](?P<i>[1-5][0-9]|[0-9])(?:\"|″|''|(?![0-9]))"
)


def _height(m: re.Match[str], zh: bool) -> str:
    first, second = int(m["f"]), int(m["i"])
    if zh:
        return f"{read_int_zh(first)}分{read_int_zh(second)}秒"
    if second > 11:
        return _sp(f"{read_int_en(first)} minutes {read_int_en(second)} seconds", zh)
    return _sp(f"{read_int_en(first)} foot {read_int_en(second)}", zh)


def _inch_mark(m: re.Match[str], zh: bool) -> str:
    before = m.string[max(0, m.start() - _QUOTE_LOOK_BACK) : m.start()].rpartition("\n")[2]
    if m.group(0).endswith('"') and len(_QUOTE_MARK.findall(before)) % 2:
        return m.group(0)
    int_part, frac = _split_num(m["num"])
    number = _read_number(int_part, frac, zh)
    if zh:
        return number + "英寸"
    one = int_part == "1" and not frac
    attributive = _before(_ARTICLE_BEFORE, m) and _NAME_OR_NOUN_AFTER.match(m.string, m.end())
    return _sp(f"{number} {'inch' if one or attributive else 'inches'}", zh)


# A noun, or a name written in capitals, after a size ("a 65\" TV", "a 27\" monitor").
_NAME_OR_NOUN_AFTER: Final = re.compile(
    r"[\s-]+(?!(?:of|per|and|or|to|in|by|x)\b)[A-Za-z]", re.ASCII
)


# Shots made out of shots taken ("made 7/10 free throws", "scored 118/120"): "seven out of ten",
# not "seven tenths".
_MADE_OF: Final = re.compile(
    r"(?<![0-9/.,])(?P<a>[0-9]{1,3})/(?P<b>[0-9]{1,3})(?![0-9/]|[.,][0-9])"
)
_MADE_BEFORE: Final = re.compile(
    r"\b(?:made|makes|hit|hits|sank|sinks|converted|completed|went|batted|shooting|shot|"
    r"scored|saved|blocked|won)\s+(?:just\s+|only\s+)?$",
    re.IGNORECASE,
)


def _made_of(m: re.Match[str], zh: bool) -> str:
    if zh or int(m["a"]) > int(m["b"]) or not _before(_MADE_BEFORE, m):
        return m.group(0)
    return _sp(f"{read_int_en(int(m['a']))} out of {read_int_en(int(m['b']))}", zh)


def _year_after(m: re.Match[str], zh: bool) -> str:
    keyword = m["kw"]
    month = _MONTH_BY_NAME.get(keyword)
    if month is not None:
        keyword = _MONTHS[month - 1]  # "Jan 2020": January, as said
    if zh:
        # Digit by digit, as Chinese says a year ("Q3 2025财报": Q三二零二五, not 二千零二十五).
        return f"{keyword} {_digits(m['y'], zh)}"
    return f"{keyword} {read_year_en(int(m['y']))} "


# A number of years, not a calendar year: after a verb that counts them ("活了1200年", "已有
# 2000年", "长达300年") or before "的历史"/"之久" ("2000年的历史"); for a number past any
# year of ours (above 2100) also after 约 and before 前, 后, 左右 ("约为5730年", "5000年前").
# A year that could be a date stays one: 到了2030年, 约1990年出生, 1644年以后, 2010年左右,
# 2023年多家银行, 2023年历史最高.
_YEARS_BEFORE: Final = re.compile(
    r"(?:活了|过了|用了|花了|经过了|经历了|存在了|持续了|延续了|流传了|相隔|相距|长达|超过|"
    r"已有|已经有|历时|将近|有着)\s?$"
)
_YEARS_AFTER: Final = re.compile(r"(?:的历史|之久)")
_YEARS_BEFORE_PAST_DATES: Final = re.compile(r"(?:约|约为|大约|大概|近|了|有|为)\s?$")
_YEARS_AFTER_PAST_DATES: Final = re.compile(r"(?:前|以前|之前|以后|之后|后|左右|以上|来|多)")


def _year_zh(m: re.Match[str], zh: bool) -> str:
    if not zh:
        return m.group(0)
    text = m.string
    past_dates = int(m["y"]) > 2100
    if (
        _YEARS_AFTER.match(text, m.end())
        or _before(_YEARS_BEFORE, m)
        or (past_dates and _YEARS_AFTER_PAST_DATES.match(text, m.end()))
        or (past_dates and _before(_YEARS_BEFORE_PAST_DATES, m))
    ):
        return read_int_zh(int(m["y"])) + "年"  # 五千七百三十年, 两千年的历史
    return _digits(m["y"], zh) + "年"


# Said as words, not as a fraction or "slash": "open 24/7", "a 50/50 chance".
_SLASH_IDIOMS: Final = {
    (24, 7): ("twenty four seven", "全天候"),
    (50, 50): ("fifty fifty", "五五开"),
    (20, 20): ("twenty twenty", "二十二十"),
    (9, 11): ("nine eleven", "九一一"),
}


# A month and a day after a word that dates ("scheduled for 3/15", "on 5/8", "due 2/28"):
# no one says "three fifteenths". Not before "of" ("on 3/4 of the days" is a fraction).
_DATE_WORD_BEFORE: Final = re.compile(
    # (not "by", "from", "after": "cut by 1/3", "from 1/2 to 3/4" are fractions)
    r"\b(?:[Oo]n|[Uu]ntil|[Tt]ill|[Tt]hrough|[Ss]ince|[Dd]ue|[Ss]cheduled for|[Ss]tarting|"
    r"[Ee]nding|[Dd]eadline is|[Dd]ated)\s+$"
)


def _month_day_date(m: re.Match[str], zh: bool) -> str | None:
    """The fraction ``m`` read as a month and a day where a word before it dates it."""
    month, day = int(m["a"]), int(m["b"])
    if not (1 <= month <= 12 and 1 <= day <= 31) or _OF_AFTER.match(m.string, m.end()):
        return None
    if not _before(_DATE_WORD_BEFORE, m):
        return None
    return _sp(_date_words(None, month, day, zh), zh)


def _fraction(m: re.Match[str], zh: bool) -> str:
    if max(len(m["a"]), len(m["b"])) > _MAX_CARDINAL_DIGITS:
        return _sp(
            _int_words(m["a"], zh) + ("斜杠" if zh else " slash ") + _int_words(m["b"], zh), zh
        )
    date = _month_day_date(m, zh)
    if date is not None:
        return date
    a, b = int(m["a"]), int(m["b"])
    idiom = _SLASH_IDIOMS.get((a, b))
    if idiom is not None:
        return _sp(idiom[1] if zh else idiom[0], zh)
    if a + b == 100 and a % 10 == 0 and b % 10 == 0 and a and b:
        # A split ("a 60/40 portfolio", "the 80/20 rule"): "sixty forty", not a fraction.
        if zh:
            return f"{read_int_zh(a)}比{read_int_zh(b)}"
        return _sp(f"{read_int_en(a)} {read_int_en(b)}", zh)
    if zh:
        if 0 < a < b:
            return f"{read_int_zh(b)}分之{read_int_zh(a)}"
        return f"{read_int_zh(a)}斜杠{read_int_zh(b)}"
    if not (0 < a < b <= 20):
        return _sp(f"{read_int_en(a)} slash {read_int_en(b)}", zh)
    return _sp(_fraction_words(a, b, article=False), zh)


def _fraction_words(a: int, b: int, article: bool) -> str:
    """ "three quarters", "one fifth"; with ``article``, "a half", "a quarter" for one part."""
    if b == 2:
        denominator = "half" if a == 1 else "halves"
    elif b == 4:
        denominator = "quarter" if a == 1 else "quarters"
    else:
        denominator = _ordinal_en(read_int_en(b)) + ("" if a == 1 else "s")
    one = "an" if denominator[0] in "aeiou" else "a"
    return f"{one if article and a == 1 else read_int_en(a)} {denominator}"


def _mixed_fraction(m: re.Match[str], zh: bool) -> str:
    whole, unit, text = m["w"], m["unit"], m.string
    before = ""  # a number before the fraction that is not its whole part
    if whole and (len(whole) > 3 or _before(_OF_BEFORE, m)):
        # "In 2020 1/3 of workers", "out of 30 2/3 passed": a number, then a fraction
        whole, before = None, text[m.start() : m.start("a")]
    if not (whole or unit) or len(m["a"]) > 2 or len(m["b"]) > 2:
        return m.group(0)  # a plain fraction (_FRACTION), or no fraction said so
    reading = _fraction_reading(m, whole, unit, zh)
    return m.group(0) if reading is None else before + reading


def _fraction_reading(
    m: re.Match[str], whole: str | None, unit: str | None, zh: bool
) -> str | None:
    """_MIXED_FRACTION's fraction with its whole part (or None) and its unit (or None), read;
    None where it is said otherwise."""
    text = m.string
    a, b = int(m["a"]), int(m["b"])
    if not 0 < a < b <= 20:
        return None
    if unit == "g" and not _GRAMS_CONTEXT.match(text, m.end()):
        return None
    if unit in _GLUED_ONLY_UNITS and text[m.start("unit") - 1].isspace():
        return None  # "1/2 W" is west; "a 1/4W resistor" a quarter watt
    singular, plural, chinese = _UNITS[unit] if unit else ("", "", "")
    if zh:
        words = f"{read_int_zh(b)}分之{read_int_zh(a)}"
        if whole:
            words = f"{read_int_zh(int(whole))}又{words}"
        return words + chinese
    if whole:
        words = f"{read_int_en(int(whole))} and {_fraction_words(a, b, article=True)}"
        return _sp(f"{words} {plural}" if unit else words, zh)
    if _before(_ARTICLE_BEFORE, m, "a"):
        # "a 1/4W resistor", "the 1/2 lb bag": a quarter watt, the half pound
        part = _fraction_words(a, b, article=False)
        part = part.removeprefix("one ") if a == 1 else part.removesuffix("s")
        return _sp(f"{part} {singular}", zh)
    article = "an" if singular[0] in "aeiou" or singular.startswith("hour") else "a"
    if a == 1 and b == 2:
        return _sp(f"half {article} {singular}", zh)
    return _sp(f"{_fraction_words(a, b, article=True)} of {article} {singular}", zh)


_NOUN_AFTER: Final = re.compile(r"[\s-]+(?!of\b|per\b|and\b|or\b|to\b)[a-z]")
_OF_BEFORE: Final = re.compile(r"\bof\s+$")
# A determiner before the amount makes it a size ("a 1/4W resistor", "the 1/2 lb bag").
_ARTICLE_BEFORE: Final = re.compile(r"\b(?:[Aa]n?|[Tt]he|[Tt]his|[Tt]hat|[Ee]ach|[Ee]very|per)\s+$")
_PER_BEFORE: Final = re.compile(r"\bper\s+$")


def _leading_point(m: re.Match[str], zh: bool) -> str:
    words = ("零点" if zh else "point ") + _digits(m["frac"], zh)
    return _sp(_signed(m, words, zh), zh)


def _is_liang(m: re.Match[str]) -> bool:
    """A "2" said 两: before a measure word, and not an ordinal (第2名 is 第二名)."""
    after_ordinal = m.start() > 0 and m.string[m.start() - 1] == "第"
    return not after_ordinal and _TAKES_LIANG.match(m.string, m.end()) is not None


def _number(m: re.Match[str], zh: bool) -> str:
    if zh and m["int"] == "2" and not m["frac"] and _is_liang(m):
        return _signed(m, "两", zh)  # 两点, 两个, 两小时: 二 is for counting and digits
    return _sp(_signed(m, _read_number(m["int"], m["frac"], zh), zh), zh)


# The micro sign (NFKD's mu) between a number and letters no unit rule took ("2.5 μIU/mL"):
# a prefix, not the letter ("μx", the mean of x, is "mu x").
_MICRO_PREFIX: Final = re.compile(r"(?<=[0-9])\s?\u03bc(?=[A-Za-z])")


def _micro_prefix(m: re.Match[str], zh: bool) -> str:
    return "微" if zh else " micro "


def _symbol(m: re.Match[str], zh: bool) -> str:
    if _GREEK_WORD.match(m.string, m.start() - 1 if m.start() else 0, m.end() + 1):
        return ""  # a Greek word ("φιλοσοφία") is not spelt letter by letter: dropped
    en, chinese = _SYMBOLS[m.group(0)]
    return _sp(chinese if zh else _comparison_words(m, en), zh)


_PER_WORDS_ZH: Final[Mapping[str, str]] = MappingProxyType(
    {
        "hour": "小时",
        "day": "天",
        "night": "晚",
        "week": "周",
        "month": "月",
        "year": "年",
        "person": "人",
        "minute": "分钟",
        "second": "秒",
        "mile": "英里",
        "item": "件",
    }
)


def _per(m: re.Match[str], zh: bool) -> str:
    word = m["w"]
    if zh:
        # "200mg/dL": 毫克每分升 (the English letters were left: 每dL)
        if word in _UNITS:
            return "每" + _UNITS[word][2]
        return "每" + (_PER_WORDS_ZH.get(_PER_WORDS[word], word) if word else "")
    return f" per {_PER_WORDS[word]} " if word else " per "


def _and_or(m: re.Match[str], zh: bool) -> str:
    return "and or"


_EQUALS_BEFORE: Final = re.compile(r"=\s*$")


def _acronym_pair(m: re.Match[str], zh: bool) -> str:
    if len(m["a"]) == 1 and len(m["b"]) == 1 and _before(_EQUALS_BEFORE, m):
        # a formula's division ("I = V/R"; "V R" before, heard as a product)
        return f"{m['a']}除以{m['b']}" if zh else f" {m['a']} divided by {m['b']} "
    return f"{m['a']} {m['b']}"


def _slash(m: re.Match[str], zh: bool) -> str:
    return "斜杠" if zh else " slash "


_Rule = tuple[re.Pattern[str], Callable[[re.Match[str], bool], str]]

# Also capitalised, as a sentence starts ("Approx. 300 people", "E.g. this").
_ABBREVIATION_FORMS: Final[Mapping[str, str]] = MappingProxyType(
    {form: a for a in _ABBREVIATIONS for form in (a, a[0].upper() + a[1:])}
)
_ABBREVIATION: Final = re.compile(
    r"(?<![A-Za-z.])(?:"
    + "|".join(re.escape(a) for a in sorted(_ABBREVIATION_FORMS, key=len, reverse=True))
    + ")"
)

# A Markdown link or image, as language models write them whatever their prompt says: its
# text is said, not its address ("[the docs](https://...)" was "the docs, example dot com").
# Bounded parts: no backtracking over a long run of brackets or an unclosed link.
_MD_LINK: Final = re.compile(
    r"!?\[(?P<text>[^\[\]\n]{0,500})\]\((?:[^()\s]{0,2000})(?:\s+\"[^\"\n]{0,200}\")?\)"
)


# Names that programmers say one way and the other rules read another ("C and. NET",
# "Node. js"): C#, F#, .NET (ASP.NET too) and the ".js" of a JavaScript library.
_TECH_NAME: Final = re.compile(
    r"(?<![A-Za-z0-9])(?P<sharp>[CF])#(?![A-Za-z0-9#])"
    r"|(?<![0-9.])(?P<net>\.NET)(?![A-Za-z0-9])"
    r"|(?<=[A-Za-z0-9])(?P<js>\.js)(?![A-Za-z0-9])",
    re.ASCII,
)


# A file name's extension, as programmers say it ("settings.py" was "settings. py", the dot
# read as a full stop).
_FILE_EXTENSIONS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "py": "pie",
        "md": "M D",
        "txt": "text",
        "json": "jason",
        "yaml": "yaml",
        "yml": "Y M L",
        "toml": "toml",
        "csv": "C S V",
        "html": "H T M L",
        "css": "C S S",
        "sh": "S H",
        "pdf": "P D F",
        "png": "P N G",
        "jpg": "J P G",
        "ts": "T S",
        "tsx": "T S X",
        "jsx": "J S X",
        "cfg": "config",
        "ini": "I N I",
        "log": "log",
        "zip": "zip",
        "exe": "E X E",
    }
)
_FILE_NAME: Final = re.compile(
    # a name's ("settings.py") or the extension alone ("all .txt files")
    r"(?<![.])\.(?P<ext>" + "|".join(_FILE_EXTENSIONS) + r")(?![A-Za-z0-9_])",
    re.ASCII,
)


def _file_name(m: re.Match[str], zh: bool) -> str:
    return f" dot {_FILE_EXTENSIONS[m['ext']]} "


# Chinese reads codes digit by digit: after a word that names one (验证码是382916, 拨打110,
# 邮编100080) or glued to capital letters (航班CA1234, G123次列车, 京A12345).
_ZH_CODE: Final = re.compile(
    r"(?P<head>(?:验证码|校验码|密码|邮编|订单号|单号|尾号|卡号|工号|学号|拨打|致电|热线|号码)"
    r"[是为:\s]{0,3}|(?<![A-Za-z])[A-Z]{1,3})(?P<digits>[0-9]{3,})"
    r"(?![0-9]|\.[0-9]|-[0-9]|,[0-9]{3}(?![0-9]))"  # no decimal, range or thousands
)


def _zh_code(m: re.Match[str], zh: bool) -> str:
    if not zh:
        return m.group(0)
    return m["head"] + _digits(m["digits"], zh)


# A hex literal ("0x1F", "0x80070005"): "hex" and its digits one by one (was "zero by one F").
_HEX: Final = re.compile(r"(?<![0-9A-Za-z_.])0[xX](?P<h>[0-9A-Fa-f]+)(?![0-9A-Za-z_])")
# Scientific notation ("1e-5", "3.5e8"): "one e minus five", as programmers say it (the
# minus was lost: "one e five" is 10^5).
_SCIENTIFIC: Final = re.compile(
    r"(?<![0-9A-Za-z_.])(?P<m>[0-9]+(?:\.[0-9]+)?)[eE](?P<sign>[-+])?(?P<e>[0-9]{1,3})"
    r"(?![0-9A-Za-z_])"
    # its unit ("5e-7 m", "3e8 m/s"), which _UNIT would not find after it is read
    r"(?:\s(?P<unit>"
    + "|".join(re.escape(u) for u in sorted(_UNITS, key=len, reverse=True))
    + r")(?![A-Za-z0-9]))?"
)


def _hex(m: re.Match[str], zh: bool) -> str:
    chars = [_ZH_DIGITS[int(c)] if zh and c.isdigit() else c for c in m["h"]]
    if not zh:
        chars = [_ONES[int(c)] if c.isdigit() else c.upper() for c in m["h"]]
    return _sp(("十六进制" if zh else "hex ") + ("" if zh else " ").join(chars), zh)


def _scientific(m: re.Match[str], zh: bool) -> str:
    int_part, frac = _split_num(m["m"])
    sign = {"-": "负" if zh else "minus ", "+": ""}.get(m["sign"] or "+", "")
    exponent = sign + _read_number(m["e"], None, zh)
    unit = m["unit"]
    if unit is None or unit in _GLUED_ONLY_UNITS or unit == "g":
        said = "" if unit is None else f" {unit}"  # "g" and "W" need their context: as written
    else:
        said = _UNITS[unit][2] if zh else f" {_UNITS[unit][1]}"
    return _sp(f"{_read_number(int_part, frac, zh)} e {exponent}", zh) + said


def _tech_name(m: re.Match[str], zh: bool) -> str:
    if m["sharp"]:
        return f" {m['sharp']} sharp "
    return " dot NET " if m["net"] else " J S "


# An address in angle brackets, as e-mail headers and Markdown autolinks write it: the
# brackets are no comparison ("Jane Doe is less than jane at example dot com").
_BRACKETED_ADDRESS: Final = re.compile(
    r"<(?P<address>(?:https?://|www\.)[^<>\s]{1,2000}|[A-Za-z0-9._%+-]{1,200}@[A-Za-z0-9.-]{1,200})>",
    re.IGNORECASE | re.ASCII,
)


def _bracketed_address(m: re.Match[str], zh: bool) -> str:
    return f" {m['address']} "


def _md_link(m: re.Match[str], zh: bool) -> str:
    return m["text"]


# A link's tail without its "[": the segmenter cut the link at a sentence end inside its
# text ("[Read this. Then](https://...)" is two pieces, read one at a time), and the second
# piece's address was said ("then, example dot com"). Its text was already said up to here.
_MD_LINK_TAIL: Final = re.compile(r"\]\((?:[^()\s]{0,2000})(?:\s+\"[^\"\n]{0,200}\")?\)")


def _md_link_tail(m: re.Match[str], zh: bool) -> str:
    return " "


# ------------------------------------------------------------------------ domain readings

_ROMAN_VALUES: Final = MappingProxyType({"I": 1, "V": 5, "X": 10, "L": 50})
_ROMAN_WELL_FORMED: Final = re.compile(r"L?X{0,3}(?:IX|IV|V?I{0,3})|XL(?:IX|IV|V?I{0,3})")


def _roman_value(numeral: str) -> int | None:
    """The value of a Roman numeral up to 89 written the standard way, else None ("IIV")."""
    if not numeral or not _ROMAN_WELL_FORMED.fullmatch(numeral):
        return None
    values = [_ROMAN_VALUES[c] for c in numeral]
    total = sum(-v if v < nxt else v for v, nxt in zip(values, [*values[1:], 0], strict=True))
    return total or None


# A reign's numeral after a monarch's or a pope's name ("Henry VIII": the eighth, spelt out
# letter by letter before). Not a lone "I" ("Mary I think..."), and only after these names
# ("Malcolm X" is no tenth).
# fmt: off
_REGNAL_NAMES: Final = (
    "John Paul", "Juan Carlos", "Victor Emmanuel", "Henry", "Louis", "Elizabeth", "George",
    "Charles", "Edward", "Richard", "James", "William", "John", "Paul", "Pius", "Benedict", "Leo",
    "Gregory", "Innocent", "Clement", "Urban", "Boniface", "Sixtus", "Napoleon", "Philip",
    "Felipe", "Frederick", "Friedrich", "Wilhelm", "Peter", "Catherine", "Mary", "Alexander",
    "Nicholas", "Ivan", "Ramesses", "Ramses", "Amenhotep", "Thutmose", "Ferdinand", "Alfonso",
    "Carlos", "Gustav", "Gustavus", "Christian", "Frederik", "Haakon", "Harald", "Olaf", "Otto",
    "Rudolf", "Francis", "Constantine", "Justinian", "David", "Robert", "Ludwig", "Leopold",
    "Umberto", "Willem", "Rama",
)
# fmt: on
_REGNAL: Final = re.compile(
    r"\b(?P<name>" + "|".join(_REGNAL_NAMES) + r")"
    r"\s+(?P<r>(?!I\b)[IVX]{1,6})\b(?![-/.][A-Za-z0-9])",
    re.ASCII,
)
# A numeral after what is numbered so ("World War II", "Type II", "Phase III", "Super Bowl
# LVIII", "Chapter IV", "Title IX"): a cardinal. A lone "L" is a letter ("Type L").
_NUMBERED_TITLE: Final = re.compile(
    r"\b(?P<head>World War|Super Bowl|[Tt]ype|[Pp]hase|[Ss]tage|Part|Chapter|Act|Scene|Book|"
    r"Volume|Episode|Level|Title|Article|Schedule|Appendix|Grade|Tier|Class|Category|Mark)"
    r"\s+(?P<r>[IVXL]{1,7})(?P<sub>[A-C]|[a-c](?![a-z]))?\b"
    r"(?:[-–](?P<r2>[IVX]{1,4})\b)?(?![-/.'][A-Za-z0-9])",  # "Stage III-IV": three to four
    re.ASCII,
)
# Where a numeral of one letter is one: a lone "I" after a lower-case head is the pronoun
# ("at this stage I would", "the type I prefer"); a lone "V" or "X" after a kind is a letter
# ("Type X drywall", "type V in vim", "Class X"); "L" and "XL" are letters or a size.
# fmt: off
_ONE_LETTER_NUMBERED: Final = frozenset({
    "Part", "Chapter", "Act", "Scene", "Book", "Volume", "Episode", "Title", "Article",
    "Schedule", "Appendix", "World War",
})
# fmt: on
# ... a lone "V" is also a numeral after these ("Level V autonomy", "Category V hurricanes");
# after "Mark" only a numeral of two letters or more is one ("Mark IV", but "Mark I said").
_V_NUMBERED: Final = frozenset({"Level", "Grade", "Class", "Category", "Phase", "Stage", "Tier"})
_WORLD_WAR: Final = re.compile(r"\bWW(?P<n>II|I|2|1)\b", re.ASCII)


_SURNAME_AFTER: Final = re.compile(r"\.(?:\s+[A-Z][a-z]|,)")
# No monarch's or pope's number is higher (John XXIII, Louis XVIII).
_MAX_REIGN: Final = 30


def _regnal(m: re.Match[str], zh: bool) -> str:
    value = _roman_value(m["r"])
    if zh or value is None:
        return m.group(0)
    if value > _MAX_REIGN or (len(m["r"]) == 1 and _SURNAME_AFTER.match(m.string, m.end())):
        return m.group(0)  # an initial ("Paul V. Smith", "Mary V., Texas")
    return f"{m['name']} the {_ordinal_en(read_int_en(value))}"


def _numbered_title(m: re.Match[str], zh: bool) -> str:
    numeral, head = m["r"], m["head"]
    value = _roman_value(numeral)
    if zh or value is None:
        return m.group(0)
    if numeral in ("L", "XL") and head != "Super Bowl":
        return m.group(0)
    if len(numeral) == 1 and head == "Mark":
        return m.group(0)
    if numeral == "I" and head.islower():
        return m.group(0)
    if numeral == "V" and head not in _ONE_LETTER_NUMBERED | _V_NUMBERED:
        return m.group(0)
    if numeral == "X" and head not in _ONE_LETTER_NUMBERED:
        return m.group(0)
    sub = f" {m['sub'].upper()}" if m["sub"] else ""  # "Stage IIIA": stage three A
    second = _roman_value(m["r2"]) if m["r2"] else None
    if m["r2"] and second is None:
        return m.group(0)
    upto = f" to {read_int_en(second)}" if second is not None else ""
    return f"{head} {read_int_en(value)}{sub}{upto}"


# "II型糖尿病", "III期临床试验": a Roman numeral before what it numbers, in Chinese.
# A lone letter there is a shape ("X型腿", "V型领口", "I型钢"): two letters or more.
_ROMAN_ZH: Final = re.compile(r"(?<![A-Za-z])(?P<r>[IVX]{2,4})(?=[型期级类度])")


def _roman_zh(m: re.Match[str], zh: bool) -> str:
    value = _roman_value(m["r"])
    return read_int_zh(value) if zh and value is not None else m.group(0)


# "χ²": chi squared, 卡方 (the square is in the Chinese name)
_CHI_SQUARED: Final = re.compile("\u03c7\\s?(?:\\^\\s?)?2(?![0-9])")  # "χ²", "χ2检验"


def _chi_squared(m: re.Match[str], zh: bool) -> str:
    return "卡方" if zh else " chi squared "


def _world_war(m: re.Match[str], zh: bool) -> str:
    n = 2 if m["n"] in ("II", "2") else 1
    return f"第{read_int_zh(n)}次世界大战" if zh else f"World War {read_int_en(n)}"


# "Python 3.x", "Node 18.x", "2.7.x": a version's wildcard ("three. x" before: the dot was
# read as a full stop). One part is a point, as "3.11" is; more are dots, as "2.7.18" are.
_VERSION_WILDCARD: Final = re.compile(
    r"(?<![0-9A-Za-z_.])(?P<v>[0-9]+(?:\.[0-9]+)*)\.[xX](?![A-Za-z0-9_]|\.[0-9A-Za-z])", re.ASCII
)


def _version_wildcard(m: re.Match[str], zh: bool) -> str:
    parts = [_read_number(p, None, zh) for p in m["v"].split(".")]
    if zh:
        return "点".join(parts) + "点x"
    joint = " point " if len(parts) == 1 else " dot "
    return _sp(joint.join([*parts, "x"]), zh)


# A US retirement account ("401(k)", "403(b)", "a 401k"): "four oh one k", as it is said
# ("four hundred one, k" before; "401k" without the brackets was 401 thousand).
_RETIREMENT_PLAN: Final = re.compile(
    r"(?<![0-9A-Za-z$€£¥.,])(?:(?P<n>401|403|457)\((?P<a>[abkK])\)|(?P<m>401k|403b|457b))"
    r"(?P<s>'?s)?(?![A-Za-z0-9])",
    re.ASCII,
)


def _retirement_plan(m: re.Match[str], zh: bool) -> str:
    number, letter = (m["n"], m["a"].lower()) if m["n"] else (m["m"][:3], m["m"][3])
    if zh:
        return _digits(number, zh) + letter
    tail = f"oh {_ONES[int(number[2])]}" if number[1] == "0" else read_int_en(int(number[1:]))
    plural = "'s" if m["s"] else ""
    return f" {_ONES[int(number[0])]} {tail} {letter}{plural} "


# "$100s", "$1000s": hundreds, thousands of dollars ("one hundred dollars s" before).
_ROUND_MONEY_PLURAL: Final = re.compile(
    r"(?<![0-9A-Za-z.,])(?P<sym>[$€£])(?P<n>100|1,?000)s"
    r"(?:\s?[-–]\s?[$€£]?(?P<n2>100|1,?000)s)?(?![A-Za-z0-9'])"  # "$100s-$1000s"
    r"(?P<of>\s+of\s+(?:thousands|millions|billions)\b)?"  # "$100s of millions"
)


def _round_money_plural(m: re.Match[str], zh: bool) -> str:
    currency = _CURRENCIES[m["sym"]]
    ends = [n for n in (m["n"], m["n2"]) if n]
    if zh:
        return "到".join("几百" if n == "100" else "几千" for n in ends) + currency.zh
    words = " to ".join("hundreds" if n == "100" else "thousands" for n in ends)
    if m["of"]:
        words += " " + " ".join(m["of"].split())
    return _sp(f"{words} of {currency.many}", zh)


# A postal code after what names it ("zip code is 94103", "ZIP: 10001-1234") or after a US
# state in an address ("Springfield, IL 62704"): digit by digit, as it is said (it was
# "sixty two thousand seven hundred four"); a ZIP+4's dash is a pause, not "to".
_POSTAL_CODE: Final = re.compile(
    r"(?<![0-9A-Za-z.,-])(?P<z>[0-9]{5})(?:-(?P<p4>[0-9]{4}))?(?![0-9A-Za-z]|[.,:/-][0-9])",
    re.ASCII,
)
# fmt: off
_US_STATES: Final = (
    "AL", "AK", "AZ", "AR", "CA", "CO", "CT", "DE", "DC", "FL", "GA", "HI", "ID", "IL", "IN", "IA",
    "KS", "KY", "LA", "ME", "MD", "MA", "MI", "MN", "MS", "MO", "MT", "NE", "NV", "NH", "NJ", "NM",
    "NY", "NC", "ND", "OH", "OK", "OR", "PA", "RI", "SC", "SD", "TN", "TX", "UT", "VT", "VA", "WA",
    "WV", "WI", "WY", "PR",
)
# fmt: on
# "zip" alone is a verb ("Zip 25000 images"): a cue only as "zip code", "ZIP", "Zip:"; a state
# only in an address, after its city ("Springfield, IL 62704"; not "CA 84531, NY 87738").
_POSTAL_CUE_BEFORE: Final = re.compile(
    r"(?:\b(?:(?:ZIP|Zip|zip)\s?[Cc]odes?|ZIP|(?:Zip|zip)\s*:|[Pp]ostal\s+[Cc]odes?|[Pp]ostcodes?)"
    r"(?:\s+is)?\s*:?\s*|[A-Za-z.],\s(?:" + "|".join(_US_STATES) + r")\s)$",
    re.ASCII,
)


def _postal_code(m: re.Match[str], zh: bool) -> str:
    if not _before(_POSTAL_CUE_BEFORE, m):
        return m.group(0)
    groups = [_digits(m["z"], zh)] + ([_digits(m["p4"], zh)] if m["p4"] else [])
    return _groups(groups, zh)


# Blood pressure ("118/76" after "blood pressure" or "BP", or before "mmHg"): "one hundred
# eighteen over seventy six" (it was "slash", and a fraction in Chinese: 七十六分之一百一十八).
_PRESSURE_PAIR: Final = re.compile(
    # (not an end of a range: "90-139/60-89mmHg" is two ranges)
    r"(?<![0-9/.,$€£¥\-–])(?P<a>[0-9]{2,3})\s?/\s?(?P<b>[0-9]{2,3})(?![0-9/]|[.,\-–][0-9])"
    r"(?P<unit>\s?mm\s?Hg\b)?",
    re.ASCII,
)
# The cue anywhere earlier in the sentence ("BP readings: 128/82 in the morning, 135/88 at
# night"), looked for this far back.
_PRESSURE_CUE_BEFORE: Final = re.compile(r"(?:[Bb]lood\s+[Pp]ressure|\bBP\b|血压)[^.!?;。！？；]*$")
_PRESSURE_LOOK_BACK: Final = 100


def _pressure_pair(m: re.Match[str], zh: bool) -> str:
    systolic, diastolic = int(m["a"]), int(m["b"])
    # A pressure's first number is the higher, each in a living range: "the 80/20 rule",
    # "on 12/15" and "100/200元" are none.
    plausible = 60 <= systolic <= 260 and 30 <= diastolic <= 160 and systolic > diastolic
    if not plausible:
        return m.group(0)
    cue = _PRESSURE_CUE_BEFORE.search(m.string, max(0, m.start() - _PRESSURE_LOOK_BACK), m.start())
    if not (m["unit"] or cue):
        return m.group(0)
    a, b = _read_number(m["a"], None, zh), _read_number(m["b"], None, zh)
    unit = _UNITS["mmHg"][2 if zh else 1] if m["unit"] else ""
    return f"高压{a}，低压{b}{unit}" if zh else _sp(f"{a} over {b} {unit}", zh)


# "L/100km", "kcal/100g", "mg/100 mL": per an amount of a unit (the unit rule reads the
# amount: "liters per one hundred kilometers"; before, "liters slash one hundred ...").
# A unit of another kind after it: the same kind is a conversion or a choice ("200°C/400°F",
# "250g/9oz", "23 kg/50 lb", "18W/30W": slash, as before).
_UNIT_ALTERNATION: Final = "|".join(re.escape(u) for u in sorted(_UNITS, key=len, reverse=True))
_PER_AMOUNT: Final = re.compile(
    rf"(?<=[0-9\s])(?P<left>{_UNIT_ALTERNATION})\s?/\s?"
    rf"(?=(?P<amount>[0-9]+)\s?(?P<right>{_UNIT_ALTERNATION})"
    r"(?![A-Za-z0-9]))"
)
# fmt: off
_UNIT_KINDS: Final[Mapping[str, str]] = MappingProxyType({
    **dict.fromkeys(("g", "kg", "mg", "\u03bcg", "mcg", "lb", "lbs"), "mass"),
    **dict.fromkeys(("km", "cm", "mm", "m", "ft", "mi", "\u03bcm", "nm"), "length"),
    **dict.fromkeys(("ml", "mL", "L", "dL", "\u03bcL", "\u03bcl", "tsp", "tbsp"), "volume"),
    **dict.fromkeys(("°C", "°F", "°"), "temperature"),
    **dict.fromkeys(("km/h", "kph", "mph", "m/s"), "speed"),
    **dict.fromkeys(("kcal", "kWh"), "energy"),
})
# fmt: on
# What a rate is ("L/100km", "kcal/100g", "mg/5 mL", "kWh/100 km", "g/km"); any other pair
# is two specs or a conversion ("16GB/1TB", "144Hz/1ms", "150 g/300 kcal": slash, as before;
# "oz" is a mass or a volume, so no kind at all).
_RATE_KINDS: Final = frozenset(
    {
        ("volume", "length"),
        ("energy", "mass"),
        ("energy", "length"),
        ("energy", "volume"),
        ("mass", "volume"),
        ("mass", "length"),
    }
)


def _per_amount(m: re.Match[str], zh: bool) -> str:
    kinds = (_UNIT_KINDS.get(m["left"]), _UNIT_KINDS.get(m["right"]))
    # a nutrition label's "per 100 g" is a rate of one kind ("1.2 g/100 g", "mg/100 g")
    per_hundred = m["amount"] == "100" and m["right"] in ("g", "ml", "mL") and kinds[0] == kinds[1]
    if kinds not in _RATE_KINDS and not per_hundred:
        return m.group(0)
    return m["left"] + ("每" if zh else " per ")


_RULES: Final[tuple[_Rule, ...]] = (
    (_BRACKETED_ADDRESS, _bracketed_address),
    (_MD_LINK, _md_link),
    (_MD_LINK_TAIL, _md_link_tail),
    (_URL, _url),
    (_EMAIL, _email),
    (_TECH_NAME, _tech_name),
    (_HEX, _hex),
    (_SCIENTIFIC, _scientific),
    (_FILE_NAME, _file_name),
    (_DOMAIN, _domain),
    (_ZH_CODE, _zh_code),
    (_ABBREVIATION, _abbreviation),
    (_CASE_VERSUS, _case_versus),
    (_GRADE_MINUS, _grade_minus),
    (_WORLD_WAR, _world_war),
    (_REGNAL, _regnal),
    (_NUMBERED_TITLE, _numbered_title),
    (_ROMAN_ZH, _roman_zh),
    (_CHI_SQUARED, _chi_squared),
    (_VERSION_WILDCARD, _version_wildcard),
    (_RETIREMENT_PLAN, _retirement_plan),
    (_ISO_DATE, _iso_date),
    (_DATE_YEAR_LAST, _date_year_last),
    (_MONTH_DAY, _month_day),
    (_TIME_RANGE, _time_range),
    (_CLOCK, _clock),
    (_DOTTED_CLOCK, _dotted_clock),
    (_HOUR_AMPM, _hour_ampm),
    (_ACRONYM, _acronym),
    (_DOTTED_NAME, _dotted_name),
    (_PAGE, _page),
    (_SERVICE_NUMBER, _service_number),
    (_POSTAL_CODE, _postal_code),
    (_RATIO, _ratio),
    (_PHONE, _phone),
    (_LOCAL_PHONE, _local_phone),
    (_DIGIT_GROUPS, _digit_groups),
    (_DOTTED, _dotted),
    (_ROUND_MONEY_PLURAL, _round_money_plural),
    (_MONEY_RANGE, _money_range),
    (_YEAR_RANGE, _year_range),
    (_PRESSURE_PAIR, _pressure_pair),
    (_MADE_OF, _made_of),
    (_MIXED_FRACTION, _mixed_fraction),
    (_UNIT_RANGE, _unit_range),
    (_TIME_UNIT_RANGE, _time_unit_range),
    (_MINUS_OP, _minus_op),
    (_RANGE, _range),
    (_SIZE_BY, _size_by),
    (_TIMES_OP, _times_op),
    (_FACTOR, _factor),
    (_NAME_OP, _name_op),  # after _FACTOR, whose algebra guard sees "3x - 2"'s minus
    (_APPROX, _approx),
    (_COMPARE, _compare),
    (_HASH_NUMBER, _hash_number),
    (_CURRENCY_SYMBOL, _money),
    (_CURRENCY_CODE, _money),
    (_PERCENT, _percent),
    (_DECIMAL_SECONDS, _decimal_seconds),
    (_HOURS_MINUTES, _hours_minutes),
    (_RESOLUTION, _resolution),
    (_HEIGHT, _height),
    (_INCH_MARK, _inch_mark),
    (_PER_AMOUNT, _per_amount),
    (_PER_POWER, _per_power),
    (_UNIT, _unit),
    (_MICRO_PREFIX, _micro_prefix),
    (_SCALED_NUMBER, _scaled_number),
    (_POWER, _power),
    (_ORDINAL, _ordinal),
    (_GLUED_SECONDS, _glued_seconds),
    (_ROUND_PLURAL, _round_plural),
    (_DECADE, _decade),
    (_YEAR_AFTER, _year_after),
    (_YEAR_IN_BRACKETS, _year_in_brackets),
    (_YEAR_ZH, _year_zh),
    (_FRACTION, _fraction),
    (_LEADING_POINT, _leading_point),
    (_NUMBER, _number),
    (_PER_SLASH, _per),
    (_AND_OR, _and_or),
    (_ACRONYM_PAIR, _acronym_pair),
    (re.compile("/"), _slash),
    (_SYMBOL, _symbol),
)


# ------------------------------------------------------------------------ punctuation


def _superscript(m: re.Match[str]) -> str:
    return "^" + m.group(0).translate(_SUPERSCRIPT_DIGITS)


def _prepare(text: str) -> str:
    """Unicode clean-up: full-width forms to ASCII, accents off Latin letters (café)."""
    # NFKD would turn "10³" into "103" and "m²" into "m2": keep the exponent an exponent.
    text = text.replace("№", "No.").translate(_SQUARE_UNITS)  # NFKD: "㎡" is "m2"
    text = _SUPERSCRIPT.sub(_superscript, text)
    # "1½" is a mixed number: NFKD makes it "11⁄2" (eleven halves) without the space.
    text = _GLUED_VULGAR_FRACTION.sub(" ", text)
    text = unicodedata.normalize("NFKD", text)
    text = "".join(ch for ch in text if not unicodedata.combining(ch))
    return text.replace("\u2212", "-").replace("\u2044", "/").replace("\r", "\n")


_SUPERSCRIPT: Final = re.compile("[⁺⁻]?[⁰¹²³⁴⁵⁶⁷⁸⁹]+")
_GLUED_VULGAR_FRACTION: Final = re.compile("(?<=[0-9])(?=[\u00bc-\u00be\u2150-\u215e])")
_SQUARE_UNITS: Final = str.maketrans(
    {"㎡": "m²", "㎥": "m³", "㎠": "cm²", "㎢": "km²", "㎤": "cm³"}
)
_SUPERSCRIPT_DIGITS: Final = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻", "0123456789+-")


def _map_punctuation(text: str, zh: bool) -> str:
    """Map the marks ChatTTS would drop onto the ones it keeps; the rest becomes space."""
    text = _APOSTROPHE.sub("", text)
    text = _SPACED_DASH.sub(",", text)
    text = text.translate(_ZH_PUNCTUATION if zh else _EN_PUNCTUATION)
    return _NOT_ALLOWED.sub(" ", text)


def _collapse(text: str, zh: bool) -> str:
    """One mark per pause: the strongest of a run wins; no leading punctuation."""

    def strongest(m: re.Match[str]) -> str:
        run = m.group(0)
        if m.start() == 0:
            return ""
        if "." in run or "。" in run:
            return "。" if zh else ". "
        if "," in run or "，" in run:
            return "，" if zh else ", "
        return "、" if zh else ", "

    text = _PUNCT_RUN.sub(strongest, text)
    text = re.sub(r"\s+", " ", text)
    if zh:
        text = _CJK_SPACE.sub("", text)
    return text.strip()


# ------------------------------------------------------------------------ entry point


def _apply(rule: Callable[[re.Match[str], bool], str], zh: bool, m: re.Match[str]) -> str:
    return rule(m, zh)


def _is_chinese(text: str, lang: str | None) -> bool:
    if lang is None:
        # A piece of a Chinese answer may hold no ideograph ("12+8=20。"): its marks say it.
        return _CJK_OR_MARK.search(text) is not None
    if lang.lower().startswith("zh"):
        return True
    if lang.lower().startswith("en"):
        return False
    raise ValueError(f"unsupported language {lang!r}: use 'en', 'zh' or None")


# What the reading makes words of, once _prepare has run: ASCII letters and digits, CJK
# ideographs, and the symbols it reads by themselves. Text with none of them reads as nothing.
# "<" and ">" are read only beside a space or digit ("3 < 4", _COMPARE): counted always, as
# refusing text the reading speaks is worse than a caption over a silent "<".
_READ_ALOUD: Final = re.compile(
    "[A-Za-z0-9\u4e00-\u9fff"
    + re.escape("".join(sorted({s[0] for s in _SYMBOLS} | {"/", "<", ">"})))
    + "]"
)


def reads_aloud(text: str) -> bool:
    """Whether ``normalize_for_tts`` makes any words of ``text``: False for dashes, dots,
    quotes, emoji, or scripts ChatTTS cannot read (Cyrillic, kana, Arabic digits), which it
    turns into nothing. Linear time and no rules run, so cheap enough for the event loop (the
    reading itself takes 0.3 s for 5000 emoji); it agrees with the reading on every single
    character but "<" and ">", counted as read (tests/test_normalize.py). Of a URL only the
    host counts, as only the host is read ("http://[::1]:8080/" reads as nothing), and of a
    Markdown link only its text."""
    text = _MD_LINK.sub(lambda m: m["text"], _prepare(text))
    text = _URL.sub(lambda m: " {} {}".format(*_url_host(m.group(0))), text)
    return _READ_ALOUD.search(text) is not None


def normalize_for_tts(text: str, lang: str | None = None) -> str:
    """Return ``text`` spelled out for ChatTTS: only CJK, A-Za-z, ``，。、,.`` and space.

    ``lang`` forces the reading ("en"/"zh", also "en-US", "zh-CN"); by default any CJK
    ideograph in ``text`` selects the Chinese reading.
    """
    text = _prepare(text)
    zh = _is_chinese(text, lang)
    for pattern, rule in _RULES:
        text = pattern.sub(partial(_apply, rule, zh), text)
    return _collapse(_map_punctuation(text, zh), zh)
