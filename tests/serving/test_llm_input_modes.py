"""The LLM input ids of CosyVoice2's three voice modes, pinned against an assembly written from the reference's
frontend (zero-shot, cross-lingual, instruct2; docs/engine.md "Voice modes") with the released tokenizer's ids."""

from __future__ import annotations

import numpy as np
import pytest

from cosyvoice2.frontend.llm_prompt import VoiceMode, instruction_text, llm_prompt
from speech_lm.testing import write_test_tokenizer
from cosyvoice2.text.tokenizer import CosyVoice2Tokenizer
from cosyvoice2.vocab import SpeechVocabLayout
from speech_serving.io_struct import PromptTensors
from speech_serving.orchestrator import Orchestrator, OrchestratorConfig, parse_request
import pipeline_contract as contract
from pipeline_contract import SpeechRequest

ENDOFPROMPT_ID = 151646  # the released tokenizer's id of <|endofprompt|>
PROMPT_SPEECH = np.array([5, 0, 6560, 17, 17, 3], np.int32)
PROMPT = PromptTensors(PROMPT_SPEECH, np.zeros((12, 80), np.float32), np.ones(192, np.float32))
TARGET = "The weather is lovely today."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> CosyVoice2Tokenizer:
    model_dir = tmp_path_factory.mktemp("model")
    write_test_tokenizer(model_dir / "CosyVoice-BlankEN", base_vocab_size=151643)  # released ids
    return CosyVoice2Tokenizer.from_model_dir(model_dir)


@pytest.fixture(scope="module")
def vocab(tokenizer) -> SpeechVocabLayout:
    return SpeechVocabLayout(text_vocab_size=len(tokenizer))


def reference_input_ids(tokenizer, vocab, mode: str, tts_text: str, prompt_text: str = "",
                        instruct_text: str = "") -> list[int]:
    """What the reference feeds its LLM, written from its frontend and Qwen2LM.inference (as flat ids).

    frontend_zero_shot -> {text, prompt_text, llm_prompt_speech_token}; frontend_cross_lingual = zero-shot with
    prompt_text and llm_prompt_speech_token deleted; frontend_instruct2 = zero-shot with prompt_text :=
    instruct_text and llm_prompt_speech_token deleted. The LLM reads [SOS, prompt_text ++ text, TASK_ID,
    llm_prompt_speech_token].
    """
    model_input = {
        "text": tokenizer.encode(tts_text),
        "prompt_text": tokenizer.encode(instruct_text if mode == "instruct2" else prompt_text),
        "llm_prompt_speech_token": [int(t) for t in PROMPT_SPEECH],
    }
    if mode == "cross_lingual":
        del model_input["prompt_text"], model_input["llm_prompt_speech_token"]
    if mode == "instruct2":
        del model_input["llm_prompt_speech_token"]
    speech = [vocab.speech_offset + t for t in model_input.get("llm_prompt_speech_token", [])]
    return [vocab.sos_id, *model_input.get("prompt_text", []), *model_input["text"], vocab.task_id_id, *speech]


def ours(tokenizer, vocab, reference_text: str, instruction: str = "") -> tuple[list[int], int, int, int]:
    orchestrator = Orchestrator(OrchestratorConfig(vocab=vocab), tokenizer, clients=None)  # type: ignore[arg-type]
    request = SpeechRequest(np.zeros(16000, np.float32), reference_text, TARGET, "voice", 1, instruction)
    llm, text_tokens = orchestrator.build_llm_request(request, PROMPT, streaming=True)
    return llm.input_ids.tolist(), text_tokens, llm.min_tokens, llm.max_tokens


def test_instruct_mode_reads_the_instruction_and_no_prompt_speech(tokenizer, vocab):
    ids, text_tokens, min_tokens, max_tokens = ours(tokenizer, vocab, "I have 2 cats.", "Speak slowly and sadly.")
    expected = reference_input_ids(tokenizer, vocab, "instruct2", TARGET,
                                   instruct_text="Speak slowly and sadly.<|endofprompt|>")
    assert ids == expected
    assert ENDOFPROMPT_ID in ids and ids.index(ENDOFPROMPT_ID) == 1 + len(tokenizer.encode("Speak slowly and sadly."))
    assert not any(vocab.speech_offset <= i < vocab.end_ids[0] for i in ids)  # no prompt speech token
    target = len(tokenizer.encode(TARGET))
    assert text_tokens == len(ids) - 2  # instruction + target text tokens are what the LLM read
    assert (min_tokens, max_tokens) == (2 * target, 20 * target)  # limits follow the target text only


def test_an_instruction_that_already_ends_in_endofprompt_gets_it_once(tokenizer, vocab):
    once, *_ = ours(tokenizer, vocab, "", "Whisper. <|endofprompt|>")
    assert once == reference_input_ids(tokenizer, vocab, "instruct2", TARGET, instruct_text="Whisper.<|endofprompt|>")
    assert once.count(ENDOFPROMPT_ID) == 1
    assert instruction_text("  Whisper.<|endofprompt|><|endofprompt|> ") == "Whisper.<|endofprompt|>"


def test_zero_shot_reads_the_normalized_transcript_and_the_prompt_speech(tokenizer, vocab):
    ids, *_ = ours(tokenizer, vocab, "I have 2 cats.")
    # the reference normalizes the transcript (digit runs spelled out) before tokenizing it
    assert ids == reference_input_ids(tokenizer, vocab, "zero_shot", TARGET, prompt_text="I have two cats.")
    assert ids[-len(PROMPT_SPEECH):] == [vocab.speech_offset + int(t) for t in PROMPT_SPEECH]


def test_cross_lingual_reads_the_target_text_only(tokenizer, vocab):
    ids, text_tokens, *_ = ours(tokenizer, vocab, "")
    assert ids == reference_input_ids(tokenizer, vocab, "cross_lingual", TARGET)
    assert ids == [vocab.sos_id, *tokenizer.encode(TARGET), vocab.task_id_id]
    assert text_tokens == len(tokenizer.encode(TARGET))
    assert ours(tokenizer, vocab, "   ")[0] == ids  # a blank transcript is no transcript


@pytest.mark.parametrize(
    ("transcript", "instruction", "mode"),
    [("hello", "", VoiceMode.ZERO_SHOT), ("", "", VoiceMode.CROSS_LINGUAL), ("hello", "sing", VoiceMode.INSTRUCT),
     ("", "sing", VoiceMode.INSTRUCT), ("hello", "  ", VoiceMode.ZERO_SHOT)],
)
def test_mode_selection(transcript, instruction, mode):
    assert llm_prompt(transcript, instruction).mode is mode


def test_the_contract_carries_the_optional_instruction():
    arrays = {
        contract.REFERENCE_WAV.name: np.zeros(8000, np.float32),
        contract.REFERENCE_WAV_LEN.name: np.array([8000], np.int32),
        contract.REFERENCE_TEXT.name: np.array([b""], object),
        contract.TARGET_TEXT.name: np.array([b"hello"], object),
        contract.VOICE_ID.name: np.array([b"v"], object),
    }
    plain = parse_request(arrays)
    assert plain.instruction == ""
    assert llm_prompt(plain.reference_text, plain.instruction).mode is VoiceMode.CROSS_LINGUAL
    arrays[contract.INSTRUCTION_TEXT.name] = np.array(["Parle doucement".encode()], object)
    instructed = parse_request(arrays)
    assert instructed.instruction == "Parle doucement"
    assert llm_prompt(instructed.reference_text, instructed.instruction).mode is VoiceMode.INSTRUCT
    assert contract.INSTRUCTION_TEXT.optional and contract.INSTRUCTION_TEXT in contract.INPUTS
