"""The Chinese reading: readings a native listener called wrong, found by a review that read
241 realistic Chinese assistant answers aloud. Each test holds a sentence as a Chinese
assistant writes it and what a native speaker says; each failed before its fix."""

from __future__ import annotations

from agent.text.normalize import ALLOWED_CHARS
from tests.test_readings import _read as spoken


def _read(text: str) -> str:
    """What the engine speaks, its Chinese pieces joined without a space."""
    out = spoken(text, joiner="")
    assert ALLOWED_CHARS.fullmatch(out)
    return out


def test_clock_after_fullwidth_colon_is_a_time_not_a_score() -> None:
    # "：" becomes ":" in _prepare, and _CLOCK refused a ":" before the hour, so _RATIO read
    # the time as a score: 起飞时间，八比三十 ("eight to thirty").
    assert "八点三十" in _read("起飞时间：08:30。")
    assert "比" not in _read("会议时间：14:00-15:30。")
    assert _read("营业时间：9:00-21:00。") == "营业时间，九点到二十一点。"


def test_subtraction_is_not_a_range() -> None:
    # "10-3=7" was 十到三等于七 ("ten to three equals seven").
    out = _read("小明有10个苹果，吃了3个，还剩10-3=7个。")
    assert "十减三等于七" in out, out


def test_celsius_range_says_to() -> None:
    # The dash between two temperatures vanished: 十摄氏度十五摄氏度 (before the fix).
    out = _read("本周气温在10℃-15℃之间。")
    assert "到" in out, out


def test_tilde_between_percentages_is_a_range_not_approximately() -> None:
    # Was 百分之三大约百分之五 ("three percent approximately five percent").
    out = _read("年化收益率约为3%~5%。")
    assert "大约" not in out, out
    assert "百分之三到百分之五" in out, out


def test_price_per_jin_and_per_hour_say_per() -> None:
    # Was 三点五元斜杠斤 ("slash jin"); 元/天 already read 每天.
    assert "斜杠" not in _read("单价3.5元/斤。")
    assert "斜杠" not in _read("停车费10元/小时。")


def test_square_meter_sign() -> None:
    # "㎡" (U+33A1) decomposes to "m2": it was read 一百二十m二.
    assert _read("这套房子面积是120㎡。") == "这套房子面积是一百二十平方米。"


def test_grams_before_a_chinese_word() -> None:
    # Was 二百g面粉: "g" was read as grams only before "of" or a phrase end.
    out = _read("请加入200g面粉。")
    assert "克" in out, out


def test_liang_before_more_measure_words() -> None:
    # README: 2 is 两 before a Chinese measure word. 二升水, 二颗鸡蛋 (before) are wrong.
    for text, said in [
        ("每天喝2升水。", "两升"),
        ("早餐吃2颗鸡蛋。", "两颗"),
        ("请带2支笔。", "两支"),
        ("加2克盐。", "两克"),
        ("买了2盒牛奶。", "两盒"),
    ]:
        out = _read(text)
        assert said in out, (text, out)


def test_liang_before_qian_and_wan() -> None:
    # Was 二千元 / 二万元: a native says 两千元 / 两万元.
    assert "两千" in _read("每月房租2000元。")
    assert "两万" in _read("预算20000元。")


def test_equation_sentence_of_a_chinese_reply_is_read_in_chinese() -> None:
    # Each segment is normalized alone; one with no ideograph but Chinese punctuation was read
    # in English in the middle of a Chinese answer: "twelve plus eight equals twenty."
    out = _read("我们来算一下。12+8=20。")
    assert out == "我们来算一下。十二加八等于二十。", out


def test_square_root_sign_is_said() -> None:
    # "√" was dropped: 所以十六等于四 ("so sixteen equals four") is false.
    out = _read("所以√16=4。")
    assert "根号" in out, out


def test_codes_after_a_cue_read_digit_by_digit() -> None:
    # Was 验证码 三十八万二千九百一十六, 拨打一百一十, 航班CA一千二百三十四: codes and
    # service numbers are read digit by digit.
    assert "三八二九一六" in _read("您的验证码是382916，5分钟内有效。")
    assert "一一零" in _read("遇到危险请拨打110报警。")
    assert "CA一二三四" in _read("您的航班CA1234明天起飞。")
