"""The Spark-TTS engine's exceptions: one base class, so callers can catch the engine's errors as one."""

from __future__ import annotations


class SparkError(Exception):
    """Base of every error raised by ``spark_tts``."""


class SparkModelError(SparkError, ValueError):
    """A model directory or checkpoint does not match the released layout."""


class SparkInputError(SparkError, ValueError):
    """A request's input (audio, text, tokens) cannot be processed."""
