"""Render options: every option is one field; its flag, its string form and its checks come from that field."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from stackbench.launch import render_fields
from triton_repo.render import add_option_flags, main, option_values
from triton_repo.render_checks import field_errors
from triton_repo.render_options import (
    CosyVoice3RenderOptions,
    RenderError,
    RenderOptions,
    SparkRenderOptions,
    _Options,
    option,
)


def options(**values: object) -> RenderOptions:
    return RenderOptions(**{"model_dir": Path("/m"), "out": Path("/o"), **values})


def test_key_value_strings_parse_by_the_field_type() -> None:
    # how stack-bench and the soak pass --render-arg FIELD=VALUE: integers already as int, the rest as strings
    opts = options(**render_fields(["flow_cache_gb=1.5", "instances=cosyvoice2=2,voice_prompt=3", "first_hop=15",
                                    "layout=single", "benchmark_speech_ratio=2"]))
    assert opts.flow_cache_gb == 1.5 and opts.first_hop == 15 and opts.benchmark_speech_ratio == 2.0
    assert opts.instances == {"cosyvoice2": 2, "voice_prompt": 3} and opts.layout == "single"
    assert options(instances=["cosyvoice2=2", "voice_prompt=3"]).instances == {"cosyvoice2": 2, "voice_prompt": 3}
    assert options(model_dir="/models/x").model_dir == Path("/models/x")
    spark = options(spark="/spark").spark
    assert spark == SparkRenderOptions(Path("/spark")) and options(spark=None).spark is None
    assert options(cosyvoice3="/cv3").cosyvoice3 == CosyVoice3RenderOptions(Path("/cv3"))


@pytest.mark.parametrize("values, slots", [
    ({}, 16),  # the CPU
    ({"device": "cuda"}, 64),  # PyTorch LLMs on a GPU
    ({"device": "cuda", "max_batch": "8"}, 8),  # what the operator says
    ({"llm_backend": "tensorrt_llm", "engine_dir": "/e"}, 16),  # an engine is built for its own maximum
    ({"device": "cuda", "spark": SparkRenderOptions(Path("/s"), engine_dir=Path("/se"))}, 16),
])
def test_llm_slots_default_by_device_and_backend(values: dict, slots: int) -> None:
    assert options(**values).max_batch == slots


@pytest.mark.parametrize("values, message", [
    ({"flow_cache_gb": "lots"}, "--flow-cache-gb expects a float"),
    ({"max_batch": "many"}, "--max-batch expects a int"),
    ({"instances": "cosyvoice2"}, "--instances expects MODEL=COUNT"),
])  # fmt: skip
def test_bad_strings_are_refused_naming_the_flag(values: dict, message: str) -> None:
    with pytest.raises(RenderError, match=message):
        options(**values)


def parse(argv: list[str]) -> RenderOptions:
    parser = argparse.ArgumentParser()
    add_option_flags(parser, RenderOptions)
    return RenderOptions(**option_values(parser.parse_args(["--model-dir", "/m", "--out", "/o", *argv]),
                                         RenderOptions))


def test_the_command_line_sets_the_fields_the_library_call_sets() -> None:
    given = parse(["--layout", "single", "--instances", "cosyvoice2=2", "--instances", "voice_prompt=3",
                   "--flow-cache-gb", "2.5", "--llm-backend", "trtllm",
                   "--spark-dir", "/s", "--spark-first-chunk", "9", "--spark-benchmark-ratio", "2",
                   "--cosyvoice3-dir", "/c", "--cosyvoice3-flow-cache", "recompute", "--cosyvoice3-second-hop", "30",
                   "--cosyvoice3-flow-cache-gb", "3"])
    assert given == options(layout="single", instances={"cosyvoice2": 2, "voice_prompt": 3}, flow_cache_gb=2.5,
                            llm_backend="tensorrt_llm",
                            spark=SparkRenderOptions(Path("/s"), first_chunk_tokens=9, benchmark_ratio=2.0),
                            cosyvoice3=CosyVoice3RenderOptions(Path("/c"), flow_cache="recompute", second_hop=30,
                                                                        flow_cache_gb=3.0))
    assert parse([]) == options()  # every flag left out keeps the field's default


def test_every_field_with_help_has_its_flag() -> None:
    parser = argparse.ArgumentParser()
    add_option_flags(parser, RenderOptions)
    flags = {flag for action in parser._actions for flag in action.option_strings}
    expected = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(RenderOptions) if f.metadata.get("help")}
    assert expected - {"--spark"} <= flags
    assert {"--spark-dir", "--spark-first-chunk", "--spark-max-new-tokens", "--layout"} <= flags
    assert {"--cosyvoice3-dir", "--cosyvoice3-flow-cache", "--cosyvoice3-flow-voices", "--cosyvoice3-flow-cache-gb",
            "--cosyvoice3-first-hop", "--cosyvoice3-second-hop", "--cosyvoice3-benchmark-ratio",
            "--cosyvoice3-engine-dir", "--cosyvoice3-llm-dir"} <= flags
    assert "--max-target-text-tokens" not in flags  # a library option: no help, no flag


def test_a_new_option_is_one_field() -> None:
    @dataclasses.dataclass(frozen=True)
    class Options(_Options):
        model_dir: Path = option(help="where")
        strict: bool = option(False, help="a switch")
        depth: int = option(3, minimum=2, help="how deep")

    parser = argparse.ArgumentParser()
    add_option_flags(parser, Options)
    args = parser.parse_args(["--model-dir", "/x", "--depth", "1", "--strict"])
    values = option_values(args, Options)
    assert values == {"model_dir": Path("/x"), "depth": 1, "strict": True}
    assert field_errors(Options(**values)) == ["--depth must be >= 2, got 1"]
    assert Options(Path("/x"), strict="true").strict is True  # FIELD=VALUE strings parse by the field type
    with pytest.raises(RenderError, match="--strict expects true or false"):
        Options(Path("/x"), strict="maybe")


def test_spark_flags_without_the_spark_dir_are_refused(tmp_path, capsys) -> None:
    assert main(["--model-dir", str(tmp_path), "--out", str(tmp_path / "r"), "--spark-first-chunk", "5"]) == 2
    assert "--spark-first-chunk need --spark-dir" in capsys.readouterr().err
