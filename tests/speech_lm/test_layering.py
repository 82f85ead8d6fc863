"""The speech-LM runtime sits below the engines: it imports no model package, and Spark-TTS (a model of another
family) imports nothing of CosyVoice2's. Read from the import statements of every file."""

from __future__ import annotations

import sys

from tests.text.test_text_segment import imported_modules

ENGINES = ("cosyvoice2", "cosyvoice3", "spark_tts")
LAYERS_ABOVE = ("speech_serving", "triton_repo", "gateway", "pipeline_contract")


def offending(package: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {where: sorted(n for n in names if n.split(".")[0] in forbidden)
             for where, names in imported_modules(package).items()}
    return {where: names for where, names in found.items() if names}


def test_the_runtime_imports_no_model_and_no_layer_above_it() -> None:
    runtime = imported_modules("speech_lm")
    assert "speech_lm/decode.py" in runtime, "the walk found no runtime module: it proves nothing"
    assert offending("speech_lm", ENGINES + LAYERS_ABOVE) == {}
    ours = {"speech_lm", "torch", "triton", "__future__"} | set(sys.stdlib_module_names)
    foreign = {where: sorted(n for n in names if n.split(".")[0] not in ours) for where, names in runtime.items()}
    assert {where: names for where, names in foreign.items() if names} == {}


def test_spark_imports_the_runtime_and_nothing_of_cosyvoice() -> None:
    spark = imported_modules("spark_tts")
    assert any(n.startswith("speech_lm.") for names in spark.values() for n in names), "no runtime import found"
    assert offending("spark_tts", ("cosyvoice2", "cosyvoice3")) == {}
