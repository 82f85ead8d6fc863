"""Text normalization and segmentation rules (docs/reference/cosyvoice2.md#text-normalization-and-segmentation).
Expected values are derived by hand from the rules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from speech_text.normalize import contains_chinese, normalize, normalize_zh, spell_out_numbers
from speech_text.segment import approximate_token_count, is_punctuation_only, segment_text, split_paragraph

REPO_ROOT = Path(__file__).resolve().parents[2]


def words(text: str) -> int:
    return len(text.split())


def test_chinese_detection() -> None:
    assert contains_chinese("hello 世界")
    assert not contains_chinese("hello, world! こんにちは")  # kana is outside U+4E00..U+9FFF


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("你好 世界", "你好世界"),  # spaces next to Chinese are removed
        ("我用 GPU 和 New York 跑", "我用GPU和New York跑"),  # ... a space between two ASCII characters stays
        ("第一行\n第二行", "第一行第二行"),
        ("面积10m²和1m³", "面积10m平方和1m立方"),
        ("3.5元", "3。5元"),
        ("用A - B表示", "用A，B表示"),
        ("（注）【重】`代码`前——后", "注重代码前 后"),
        ("天气很好，,、", "天气很好。"),
    ],
)
def test_chinese_cleanup_rules(raw: str, expected: str) -> None:
    assert normalize_zh(raw) == expected


def test_english_digit_runs_are_spelled_out() -> None:
    assert spell_out_numbers("I have 3 cats and 1999 dogs") == (
        "I have three cats and one thousand, nine hundred and ninety-nine dogs"
    )
    assert spell_out_numbers("no digits") == "no digits"


def test_normalize_strips_and_skips_special_token_text() -> None:
    assert normalize("  It is 2 pm \n") == "It is two pm"
    assert normalize("A<|endofprompt|> 12 ") == "A<|endofprompt|> 12 "


def test_english_split_flushes_above_max_and_merges_short_tail() -> None:
    sentence = " one two three four five six seven eight nine ten."
    ten = sentence * 10
    segments = split_paragraph(ten, "en", words)
    # 7 sentences = 70 words > 60 but 70 + 10 = 80 is not > 80, so an 8th joins; the 2-sentence tail (20 words) is
    # not < merge_len and stays separate.
    assert segments == [sentence * 8, sentence * 2]
    # With 9 sentences the 10-word tail is < 20 and joins the previous segment.
    assert split_paragraph(sentence * 9, "en", words) == [sentence * 9]


def test_long_chinese_text_becomes_several_segments_under_the_limit() -> None:
    sentence = "今天天气很好，我们一起去公园散步吧。"  # 18 characters
    segments = segment_text(sentence * 12)
    assert segments == [sentence * 4] * 3  # 72 > 60 and 72 + 18 > 80 closes each segment
    assert all(len(s) <= 80 for s in segments)


def test_long_english_text_with_default_counter_respects_limits() -> None:
    text = " ".join(f"Sentence {n} has a handful of ordinary words in it." for n in range(1, 16))
    segments = segment_text(text)
    assert len(segments) > 1
    assert "".join(segments) == normalize(text)  # nothing lost or reordered
    counts = [approximate_token_count(s) for s in segments]
    assert all(c <= 80 for c in counts[:-1])
    assert all(c > 60 for c in counts[:-1])


def test_missing_terminator_is_appended() -> None:
    assert segment_text("Hello world") == ["Hello world."]
    assert segment_text("你好") == ["你好。"]


def test_closing_quotes_stay_with_their_sentence() -> None:
    tight = dict(token_max_n=3, token_min_n=0, merge_len=0)
    assert split_paragraph('He said "Stop." Then he left.', "en", words, **tight) == ['He said "Stop."', " Then he left."]
    assert split_paragraph("他说：“走吧。”然后走了。", "zh", **tight) == ["他说：", "“走吧。”", "然后走了。"]


def test_second_of_two_terminators_is_dropped_like_upstream() -> None:
    assert split_paragraph("Really?! Yes.", "en", words) == ["Really? Yes."]


def test_punctuation_only_detection_and_dropping() -> None:
    assert is_punctuation_only("。！？…—«»$+")
    assert is_punctuation_only("")
    assert not is_punctuation_only("a.")
    assert not is_punctuation_only(" .")
    assert segment_text('"..."') == []


@pytest.mark.parametrize("text", ["", "   ", " \n\t "])
def test_empty_input_gives_no_segments(text: str) -> None:
    assert segment_text(text) == []


def test_special_token_text_is_passed_through_whole() -> None:
    text = "Speak slowly.<|endofprompt|> It costs 12 dollars"
    assert segment_text(text) == [text]


def test_pluggable_counter_is_used_for_english() -> None:
    text = "a b c. d e f."
    assert segment_text(text, token_count=lambda s: 100 * len(s.split())) == ["a b c.", " d e f."]


def test_approximate_token_count() -> None:
    assert approximate_token_count("Hello world.") == 3  # "Hello", " world", "."
    assert approximate_token_count("internationalization") == 4  # 20 letters / 6 per token, rounded up


def test_segment_module_imports_without_torch() -> None:
    code = (
        "import sys, speech_text.segment; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


def imported_modules(*packages: str) -> dict[str, set[str]]:
    """Top-level module -> the modules it names in its import statements, for every file of ``packages``."""
    found: dict[str, set[str]] = {}
    for package in packages:
        for path in (REPO_ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
            names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
            found[str(path.relative_to(REPO_ROOT))] = names
    return found


def test_the_text_package_imports_no_engine_and_no_other_layer() -> None:
    ours = {"speech_text", "inflect", "__future__"} | set(sys.stdlib_module_names)
    foreign = {where: sorted(n for n in names if n.split(".")[0] not in ours)
               for where, names in imported_modules("speech_text").items()}
    assert {where: names for where, names in foreign.items() if names} == {}


def test_the_gateway_and_spark_take_text_rules_from_the_text_package() -> None:
    # the gateway is model-neutral: no engine at all; Spark-TTS shares the speech-LM runtime, not CosyVoice2's text
    # frontend
    gateway = imported_modules("gateway")
    assert "speech_text.segment" in gateway["gateway/app.py"], "the walk found no gateway import: it proves nothing"
    engine = {where: sorted(n for n in names if n.split(".")[0] in ("cosyvoice2", "speech_serving"))
              for where, names in gateway.items()}
    engine_text = {where: sorted(n for n in names if n == "cosyvoice2.text" or n.startswith("cosyvoice2.text."))
                   for where, names in imported_modules("spark_tts").items()}
    assert {where: names for where, names in {**engine, **engine_text}.items() if names} == {}
