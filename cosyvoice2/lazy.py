"""Lazy package exports: a package names its public objects without importing the modules that define them.

The configuration modules (``cosyvoice2.config``, ``cosyvoice2.llm.config``, ``cosyvoice2.flow.config`` ...) must
import without torch, yet importing them runs their package's ``__init__``; so the packages resolve their torch-backed
names on first access instead of at import time (PEP 562 module ``__getattr__``).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_exports(namespace: dict[str, Any], exports: Mapping[str, str]) -> tuple[Callable[[str], Any],
                                                                                Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for a package whose public ``name`` lives in module ``exports[name]``."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
