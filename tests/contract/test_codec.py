"""The one codec of the pipeline contract: what every client encodes is what the pipeline decodes."""

from __future__ import annotations

import numpy as np
import pytest

import pipeline_contract as contract

WAV = np.linspace(-0.5, 0.5, 3200, dtype=np.float32)


def _request(**changes) -> contract.SpeechRequest:
    fields = dict(reference_wav=WAV, reference_text="a transcript", target_text="Speak this.", voice_id="v1")
    return contract.SpeechRequest(**{**fields, **changes})


@pytest.mark.parametrize("seed, instruction", [(None, ""), (2**63 + 5, ""), (7, "Speak slowly, ünïcode.")])
def test_requests_survive_encoding_and_decoding(seed, instruction):
    request = _request(seed=seed, instruction=instruction)
    arrays = contract.encode_request(request)
    specs = {spec.name: spec for spec in contract.INPUTS}
    for name, value in arrays.items():  # every tensor has its spec's dtype (what Triton's config declares)
        assert value.dtype == np.dtype(specs[name].numpy_dtype), name
    assert (contract.SEED.name in arrays) is (seed is not None)
    assert (contract.INSTRUCTION_TEXT.name in arrays) is bool(instruction)
    decoded = contract.decode_request(arrays)
    np.testing.assert_array_equal(decoded.reference_wav, WAV)
    assert (decoded.reference_text, decoded.target_text, decoded.voice_id) == ("a transcript", "Speak this.", "v1")
    assert (decoded.seed, decoded.instruction) == (seed, instruction)


def test_grpc_inputs_are_the_encoded_tensors_under_their_declared_types():
    inputs = contract.grpc_inputs(_request(seed=3, instruction="Calm."))
    declared = {spec.name: spec.triton_dtype for spec in contract.INPUTS}
    assert [(i.name(), i.datatype()) for i in inputs] == [(name, declared[name]) for name in declared]


def test_an_id_only_request_carries_no_reference_tensors_and_decodes_as_such():
    request = contract.id_only(_request(seed=3))
    assert request.voice_id == "v1" and not request.carries_audio and _request().carries_audio
    arrays = contract.encode_request(request)
    assert contract.REFERENCE_WAV.name not in arrays and contract.REFERENCE_WAV_LEN.name not in arrays
    decoded = contract.decode_request(arrays)
    assert not decoded.carries_audio and decoded.reference_text == "a transcript" and decoded.seed == 3
    assert [i.name() for i in contract.grpc_inputs(request)] == list(arrays)


@pytest.mark.parametrize("missing", [contract.REFERENCE_WAV.name, contract.REFERENCE_WAV_LEN.name])
def test_half_a_reference_is_a_violation(missing):
    arrays = {**contract.encode_request(_request()), missing: None}
    with pytest.raises(contract.ContractViolation, match="come together"):
        contract.decode_request(arrays)


def test_payload_bytes_count_what_the_tensors_carry():
    with_audio = contract.payload_bytes(contract.encode_request(_request()))
    by_id = contract.payload_bytes(contract.encode_request(contract.id_only(_request())))
    # three strings, each a 4-byte length and its UTF-8 bytes; the audio's float32 samples and its length
    assert by_id == (4 + len("a transcript")) + (4 + len("Speak this.")) + (4 + len("v1"))
    assert with_audio == by_id + WAV.nbytes + 4


@pytest.mark.parametrize("text", ["", "  \n\t "])
def test_blank_target_text_is_the_warm_up_request(text):
    assert contract.decode_request(contract.encode_request(_request(target_text=text))).target_text == ""


def test_the_reference_is_cut_to_its_valid_length():
    arrays = contract.encode_request(_request())
    arrays[contract.REFERENCE_WAV_LEN.name] = np.array([contract.MIN_REFERENCE_SAMPLES], np.int32)
    assert contract.decode_request(arrays).reference_wav.size == contract.MIN_REFERENCE_SAMPLES


@pytest.mark.parametrize(
    "name, value, message",
    [
        (contract.REFERENCE_WAV_LEN.name, np.array([contract.MIN_REFERENCE_SAMPLES - 1], np.int32), "reference_wav_len"),
        (contract.REFERENCE_WAV_LEN.name, np.array([WAV.size + 1], np.int32), "reference_wav_len"),
        (contract.REFERENCE_WAV_LEN.name, None, "reference_wav_len"),
        (contract.REFERENCE_WAV.name, np.full(WAV.size, np.inf, np.float32), "infinite"),
        (contract.TARGET_TEXT.name, np.array([b"\xff"], object), "UTF-8"),
        (contract.TARGET_TEXT.name, np.array([b"a", b"b"], object), "exactly one string"),
        (contract.VOICE_ID.name, np.array([b""], object), "voice_id"),
    ],
)
def test_requests_that_break_the_contract_say_what_is_wrong(name, value, message):
    arrays = {**contract.encode_request(_request()), name: value}
    with pytest.raises(contract.ContractViolation, match=message):
        contract.decode_request(arrays)


def test_a_reference_longer_than_the_limit_is_refused():
    long = np.zeros(contract.MAX_REFERENCE_SAMPLES + 1, np.float32)
    with pytest.raises(contract.ContractViolation, match="reference_wav_len"):
        contract.decode_request(contract.encode_request(_request(reference_wav=long)))


@pytest.mark.parametrize("sample_rate", [contract.OUTPUT_SAMPLE_RATE, 16_000])
def test_responses_survive_encoding_and_decoding(sample_rate):
    chunk = contract.SpeechChunk(
        np.arange(5, dtype=np.float32), input_tokens=12, output_tokens=40, final=True, sample_rate=sample_rate
    )
    arrays = contract.encode_response(chunk)
    specs = {spec.name: spec for spec in contract.OUTPUTS}
    assert set(arrays) == set(specs)
    for name, value in arrays.items():
        assert value.dtype == np.dtype(specs[name].numpy_dtype), name
    decoded = contract.decode_response(arrays.get, final=True)
    np.testing.assert_array_equal(decoded.waveform, chunk.waveform)
    assert (decoded.input_tokens, decoded.output_tokens, decoded.final) == (12, 40, True)
    assert decoded.sample_rate == sample_rate


def test_a_flag_only_response_is_an_empty_chunk_without_usage():
    decoded = contract.decode_response({}.get, final=True)
    assert decoded.waveform.size == 0 and (decoded.input_tokens, decoded.output_tokens, decoded.final) == (0, 0, True)


@pytest.mark.parametrize("rate", [None, np.array([0], np.int32)])
def test_audio_without_its_sample_rate_is_a_violation(rate):
    arrays = {**contract.encode_response(contract.SpeechChunk(np.ones(4, np.float32), 1, 2, final=False)),
              contract.SAMPLE_RATE.name: rate}  # fmt: skip
    with pytest.raises(contract.ContractViolation, match="sample_rate"):
        contract.decode_response(arrays.get, final=False)


def test_the_contract_imports_nothing_of_ours():
    import ast  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    tree = ast.parse(Path(contract.__file__).read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert {m.split(".")[0] for m in modules} <= {"__future__", "dataclasses", "typing", "numpy", "tritonclient"}
