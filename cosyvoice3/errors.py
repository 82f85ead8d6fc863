"""The CosyVoice3 engine's exceptions: one base class, so callers can catch the engine's errors as one."""

from __future__ import annotations


class CosyVoice3Error(Exception):
    """Base of every error raised by ``cosyvoice3``."""


class CosyVoice3ConfigError(CosyVoice3Error, ValueError):
    """A configuration file or mapping does not describe a CosyVoice3 this engine implements."""


class CosyVoice3ModelError(CosyVoice3Error, ValueError):
    """A model directory or checkpoint does not match the released layout (the message names file and key)."""


class CosyVoice3InputError(CosyVoice3Error, ValueError):
    """A request's input (text ids, tokens, prompt features) cannot be processed."""
