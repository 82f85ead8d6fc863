"""Properties of voice names (hypothesis): what validation lets through can never reach the file system or
pose as an id, names are one per case-folded spelling, in one process and across replicas sharing a directory."""

from __future__ import annotations

import string
import tempfile
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gateway.errors import InvalidRequest
from gateway.services.voice_library import MAX_NAME_CHARS, RESERVED_NAME_PREFIX, validate_name
from gateway.services.voice_store import NameTaken, VoiceStore, name_key
from gateway.services.voices import Voice, VoiceRegistry, voice_id

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
names = st.text(min_size=0, max_size=80)


@PROPERTY
@given(raw=names)
def test_an_accepted_name_is_safe(raw):
    try:
        name = validate_name(raw)
    except InvalidRequest as exc:
        assert exc.param == "name" and exc.status == 400
        return
    assert name == name.strip() and 0 < len(name) <= MAX_NAME_CHARS
    assert not {"/", "\\"} & set(name) and name not in {".", ".."}
    assert not any(unicodedata.category(c).startswith("C") for c in name)
    assert not name.casefold().startswith(RESERVED_NAME_PREFIX)


@PROPERTY
@given(name=st.text(min_size=1, max_size=64))
def test_the_claim_file_name_holds_no_user_text_and_ignores_case(name):
    key = name_key(name)
    assert set(key) <= set(string.hexdigits.lower()) and len(key) == 32
    assert name_key(name.casefold()) == key
    assert name_key(name.upper().casefold()) == name_key(name.upper())


def _voice(name: str, seed: int) -> Voice:
    samples = (0.2 * np.sin(np.arange(16_000) * (0.01 + seed * 0.001))).astype(np.float32)
    return Voice(voice_id(samples, f"words {seed}"), name, f"words {seed}", samples, created_at=seed, uploaded=True)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=20))
def test_two_replicas_never_both_store_one_name(name):
    assume(name.strip())
    with tempfile.TemporaryDirectory() as directory:
        first, second = VoiceStore(Path(directory)), VoiceStore(Path(directory))
        first.save(_voice(name, 1))
        variant = name.swapcase() if name.swapcase().casefold() == name.casefold() else name
        with pytest.raises(NameTaken):
            second.save(_voice(variant, 2))
        assert [v.name for v in second.load()] == [name]
        registry = VoiceRegistry([], uploads=second)
        assert registry.find(variant) is not None and registry.find(variant).name == name
        first.delete(registry.find(name).id)
        assert registry.find(name) is None
        second.save(_voice(variant, 3))  # deleting frees the name
        assert registry.find(name).name == variant
