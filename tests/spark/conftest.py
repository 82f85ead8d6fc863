"""Spark-TTS engine fixtures: the shared micro model (released layout, random weights) and the upstream
runtime's outputs for it (``parity_spark``; its README gives the inputs and tolerances quoted in docs/spark.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import FIXTURES_DIR
from tests.oracle import max_abs  # noqa: F401 - the parity tests import it from here

PARITY_DIR = FIXTURES_DIR / "parity_spark"
MICRO_DIR = PARITY_DIR / "micro"
DUMP_FILE = PARITY_DIR / "micro_dump_seed1234.npz"

needs_parity_data = pytest.mark.skipif(not DUMP_FILE.exists(), reason="parity data absent")




@pytest.fixture(scope="session")
def dump() -> dict[str, np.ndarray]:
    with np.load(DUMP_FILE) as arrays:
        return {k: arrays[k] for k in arrays.files}


@pytest.fixture(scope="session")
def engine():
    from spark_tts.engine import SparkTTS

    torch.set_grad_enabled(False)
    return SparkTTS.load(MICRO_DIR)


#: A target text of another length than the oracle's: its prompt puts every LLM row at other positions.
OTHER_TARGET_TEXT = "Hello there."


@pytest.fixture(scope="session")
def other_inputs_dump(engine, dump) -> dict[str, np.ndarray]:
    """The dump of the same layout for another request (`OTHER_TARGET_TEXT`), as a second oracle with other
    inputs would hold it: the prompt arrays rebuilt, the LLM arrays computed by our LM, which matches the oracle
    to 5e-5 (test_parity_llm.py). Tests that read positions and lengths from the dump pass on it; a test that
    hard-codes the seed-1234 dump's positions does not."""
    from spark_tts.prompt import build_prompt

    prompt = build_prompt(OTHER_TARGET_TEXT, dump["at_global_tokens"][0], str(dump["in_reference_text"]),
                          dump["at_semantic_tokens"])
    ids = engine.tokenizer.encode(prompt)
    assert len(ids) != dump["llm_input_ids"].shape[1]
    lm = engine.lm
    sequence = torch.tensor(ids + dump["llm_teacher_ids"][0].tolist(), dtype=torch.int64)
    hidden = lm.hidden(lm.embed_prefix(sequence))[0]
    logits = lm.logits(hidden)
    head = len(ids) - 1
    return {
        **dump,
        "in_target_text": np.array(OTHER_TARGET_TEXT),
        "llm_prompt": np.array(prompt),
        "llm_input_ids": np.array([ids], dtype=np.int32),
        "llm_hidden": hidden.numpy(),
        "llm_logits_head": logits[head : head + len(dump["llm_logits_head"])].numpy(),
        "llm_logsumexp": logits.logsumexp(-1).numpy(),
        "llm_logp_next": torch.log_softmax(logits, -1)[:-1].gather(1, sequence[1:, None])[:, 0].numpy(),
        "llm_argmax": logits.argmax(-1).numpy().astype(np.int32),
    }


@pytest.fixture(params=["seed-1234 oracle", "other inputs"])
def any_dump(request, dump) -> dict[str, np.ndarray]:
    """The oracle's dump, then one of the same layout with other inputs (`other_inputs_dump`)."""
    return dump if request.param == "seed-1234 oracle" else request.getfixturevalue("other_inputs_dump")


@pytest.fixture(scope="session")
def reference(dump) -> np.ndarray:
    """The request's valid reference samples (the buffer's tail is filler the runtime must drop)."""
    return dump["in_reference_wav"][0, : int(dump["in_reference_wav_len"][0, 0])]
