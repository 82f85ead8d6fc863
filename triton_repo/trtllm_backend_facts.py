"""What Triton's `tensorrtllm` backend (inflight_batcher_llm, C++) requires and reads, per TensorRT-LLM version.

A fact table, written in our own words from the backend's sources, and the checks that hold a rendered
`tensorrt_llm` model config and every request the orchestrator sends to it against that table. The backend is
unforgiving in two ways the rest of the repository cannot see without it:

* a few model parameters are read *without a default*: if one is missing the model fails to load
  ("Cannot find parameter with name: ...");
* request inputs are looked up by name: an input whose name the backend does not know is ignored without a
  word, so a renamed input silently turns a feature off (a minimum length, a per-request seed).

Where each fact comes from (docs/deploy.md, "TensorRT-LLM backend facts", says the same for operators):

* TensorRT-LLM 0.19: `triton-inference-server/tensorrtllm_backend` tag v0.19.0, read directly:
  `inflight_batcher_llm/src/model_state.cc` (parameter lookup: a missing key throws), `model_instance_state.cc`
  (which lookups are guarded by a default), `utils.h` (input names), `utils.cc` (how each input is read).
* TensorRT-LLM 0.20 (the `25.06-trtllm-python-py3` image: TensorRT-LLM 0.20.0, TensorRT 10.10, Triton 2.59):
  from v0.20.0 the backend sources live in NVIDIA/TensorRT-LLM (`triton_backend/`); the backend repository only
  pins it as a submodule. The 0.20 model template (as deployed on the 25.06 image by upstream CosyVoice's
  `runtime/triton_trtllm`, July 2025) declares the same inputs and parameters as 0.19's, so the 0.19 reading
  carries over; the renames below came later on TensorRT-LLM's main branch.
* Renamed inputs (`min_length` -> `min_tokens`, `random_seed` -> `seed`): TensorRT-LLM's current
  `triton_backend/inflight_batcher_llm/src/utils.h` and its `tensorrt_llm/config.pbtxt`. The first release that
  ships them was not pinned down, so no version maps to that table: a version outside `PINNED.versions` is
  refused (the render step says so) instead of guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np


@dataclass(frozen=True)
class InputFact:
    """One request input as the backend reads it (per request, i.e. after the batch dimension of 1)."""

    dtype: str  # Triton dtype name ("INT32", "FP32", "UINT64", "BOOL"); the C++ reads the raw bytes as that type
    #: Elements per request: 1 for a singleton (read with a size check), None for a vector of any length.
    elements: int | None = 1
    #: Flattened [words..., offsets...]: an even number of elements (the backend's word-list format).
    word_list: bool = False


@dataclass(frozen=True)
class BackendFacts:
    """The tensorrtllm backend of a set of TensorRT-LLM releases."""

    label: str
    versions: tuple[str, ...]  # "major.minor" releases this table was verified for
    source: str
    #: Model parameters looked up without a default: absent, the model does not load.
    required_parameters: frozenset[str]
    #: Parameters whose value must be one of these (the backend throws on anything else).
    parameter_choices: Mapping[str, frozenset[str]]
    #: Every request input the backend reads, by name.
    inputs: Mapping[str, InputFact]
    #: Inputs every request must carry (the backend throws without them).
    required_inputs: frozenset[str]
    #: The backend's name of each sampling control we rely on (role -> input name).
    roles: Mapping[str, str]
    outputs: Mapping[str, str] = field(default_factory=dict)  # name -> dtype

    def covers(self, version: str) -> bool:
        return _major_minor(version) in self.versions


def _major_minor(version: str) -> str:
    return ".".join(version.strip().split(".")[:2])


#: Inputs both tables share (names unchanged across the rename).
_COMMON_INPUTS: dict[str, InputFact] = {
    "input_ids": InputFact("INT32", None),
    "input_lengths": InputFact("INT32"),
    "request_output_len": InputFact("INT32"),  # maxNewTokens: a request without it is rejected
    "end_id": InputFact("INT32"),
    "pad_id": InputFact("INT32"),
    "stop_words_list": InputFact("INT32", None, word_list=True),
    "bad_words_list": InputFact("INT32", None, word_list=True),
    "embedding_bias": InputFact("FP32", None),  # one value per vocabulary row of the engine's logits
    "beam_width": InputFact("INT32"),
    "runtime_top_k": InputFact("INT32"),
    "runtime_top_p": InputFact("FP32"),
    "temperature": InputFact("FP32"),
    "len_penalty": InputFact("FP32"),
    "repetition_penalty": InputFact("FP32"),
    "presence_penalty": InputFact("FP32"),
    "frequency_penalty": InputFact("FP32"),
    "no_repeat_ngram_size": InputFact("INT32"),
    "exclude_input_in_output": InputFact("BOOL"),
    "return_log_probs": InputFact("BOOL"),
    # read straight from the request (not through the tensor map): cancellation and streaming
    "stop": InputFact("BOOL"),
    "streaming": InputFact("BOOL"),
}

_PARAMETER_CHOICES = {
    "gpt_model_type": frozenset({"V1", "v1", "inflight_batching", "inflight_fused_batching"}),
    "decoding_mode": frozenset(
        {"top_k", "top_p", "top_k_top_p", "beam_search", "medusa", "redrafter", "lookahead", "eagle"}
    ),
    # empty or the template placeholder disables guided decoding; otherwise only xgrammar exists
    "guided_decoding_backend": frozenset({"", "xgrammar"}),
}

_REQUIRED_PARAMETERS = frozenset(
    {
        "gpt_model_type",  # batching type: read unguarded
        # guided decoding config: all three read unguarded, every load; empty values switch it off
        "tokenizer_dir",
        "xgrammar_tokenizer_info_path",
        "guided_decoding_backend",
    }
)

_OUTPUTS = {"output_ids": "INT32", "sequence_length": "INT32"}

#: TensorRT-LLM 0.19 and 0.20: what the pinned `25.06-trtllm-python-py3` image runs.
PINNED = BackendFacts(
    label="tensorrtllm backend of TensorRT-LLM 0.19/0.20",
    versions=("0.19", "0.20"),
    source="tensorrtllm_backend v0.19.0 inflight_batcher_llm/src; the 0.20 template as deployed on the 25.06 image",
    required_parameters=_REQUIRED_PARAMETERS,
    parameter_choices=_PARAMETER_CHOICES,
    inputs={**_COMMON_INPUTS, "min_length": InputFact("INT32"), "random_seed": InputFact("UINT64")},
    required_inputs=frozenset({"input_ids", "input_lengths", "request_output_len"}),
    roles={"min_tokens": "min_length", "seed": "random_seed"},
    outputs=_OUTPUTS,
)

#: Later backends (TensorRT-LLM main, `triton_backend/`): the same, with two sampling inputs renamed.
RENAMED = BackendFacts(
    label="tensorrtllm backend with renamed sampling inputs (TensorRT-LLM main, after 0.20)",
    versions=(),  # first release unverified: never selected by version, only named in refusals and tests
    source="NVIDIA/TensorRT-LLM triton_backend/inflight_batcher_llm/src/utils.h (main)",
    required_parameters=_REQUIRED_PARAMETERS,
    parameter_choices=_PARAMETER_CHOICES,
    inputs={**_COMMON_INPUTS, "min_tokens": InputFact("INT32"), "seed": InputFact("UINT64")},
    required_inputs=frozenset({"input_ids", "input_lengths", "request_output_len"}),
    roles={"min_tokens": "min_tokens", "seed": "seed"},
    outputs=_OUTPUTS,
)

KNOWN = (PINNED,)


class UnsupportedBackendVersion(ValueError):
    """No verified fact table for the engine's TensorRT-LLM version."""


def facts_for(version: str) -> BackendFacts:
    """The table verified for `version` (the engine's TensorRT-LLM version); refuse any other."""
    for facts in KNOWN:
        if facts.covers(version):
            return facts
    verified = ", ".join(v for facts in KNOWN for v in facts.versions)
    raise UnsupportedBackendVersion(
        f"the engine was built with TensorRT-LLM {version}, but the tensorrt_llm requests are verified only for "
        f"TensorRT-LLM {verified} (the pinned 25.06 image); newer backends renamed "
        + ", ".join(f"{PINNED.roles[r]} -> {RENAMED.roles[r]}" for r in PINNED.roles)
        + " and ignore unknown inputs silently (see docs/deploy.md before moving the image)"
    )


# -- checks ----------------------------------------------------------------------------------------
def engine_version_problems(engine: Mapping, flag: str, directory: object) -> list[str]:
    """What is wrong with the TensorRT-LLM version an engine's config.json names (`flag`: the render option that
    gave the engine `directory`): none named, or one with no pinned backend facts."""
    version = engine.get("version")
    if not version:
        return [f"{flag} {directory}: config.json names no TensorRT-LLM version; rebuild the engine"]
    try:
        facts_for(str(version))
    except UnsupportedBackendVersion as exc:
        return [f"{flag}: {exc}"]
    return []


def check_parameters(params: Mapping[str, str], facts: BackendFacts) -> list[str]:
    """A rendered model's parameters (key -> string_value) against the backend's requirements."""
    errors = [
        f"parameter {key} missing: the backend reads it without a default and fails to load "
        f'("Cannot find parameter with name: {key}")'
        for key in sorted(facts.required_parameters)
        if key not in params
    ]
    for key, allowed in sorted(facts.parameter_choices.items()):
        if key in params and params[key] not in allowed:
            errors.append(f"parameter {key}={params[key]!r} is not one of {sorted(allowed)}")
    if params.get("guided_decoding_backend") and not params.get("xgrammar_tokenizer_info_path"):
        errors.append("guided_decoding_backend is set without xgrammar_tokenizer_info_path")
    return errors


def check_declared_inputs(declared: Mapping[str, str], facts: BackendFacts) -> list[str]:
    """Declared inputs (name -> Triton dtype) of the rendered model: each one the backend reads, same dtype."""
    errors = []
    for name, dtype in declared.items():
        fact = facts.inputs.get(name)
        if fact is None:
            errors.append(f"input {name} is declared but {facts.label} never reads it (it would be ignored)")
        elif fact.dtype != dtype:
            errors.append(f"input {name} is declared {dtype}, the backend reads {fact.dtype}")
    for name in sorted(facts.required_inputs - set(declared)):
        errors.append(f"input {name} is required by the backend but not declared")
    return errors


def check_request(tensors: Mapping[str, np.ndarray], facts: BackendFacts, roles: Iterable[str] = ()) -> list[str]:
    """One BLS request (name -> numpy array with the batch dimension of 1) against what the backend reads.

    `roles` names the sampling controls the request is meant to carry (e.g. "min_tokens", "seed"): each must
    be present under the backend's name for it, or the feature is silently off.
    """
    errors = []
    is_stop = "stop" in tensors and bool(np.asarray(tensors["stop"]).reshape(-1)[0])
    for name, array in tensors.items():
        fact = facts.inputs.get(name)
        if fact is None:
            errors.append(f"request input {name} is not read by {facts.label}: it is ignored without an error")
            continue
        array = np.asarray(array)
        expected = np.dtype(_NUMPY[fact.dtype])
        if array.dtype != expected:
            errors.append(f"request input {name} is {array.dtype}, the backend reads {expected}")
        if array.ndim < 1 or array.shape[0] != 1:
            errors.append(f"request input {name} has shape {array.shape}: the batch dimension must be 1")
            continue
        per_request = int(np.prod(array.shape[1:], dtype=np.int64))
        if fact.elements is not None and per_request != fact.elements:
            errors.append(f"request input {name} holds {per_request} values per request, the backend reads {fact.elements}")
        if fact.word_list and per_request % 2:
            errors.append(f"request input {name} must hold [words..., offsets...] (an even count), got {per_request}")
    for name in sorted(facts.required_inputs - set(tensors)):
        errors.append(f"request lacks required input {name}")
    if not is_stop:
        for role in roles:
            name = facts.roles.get(role, role)
            if name not in tensors:
                errors.append(f"request does not carry {role} as {name!r}, the name {facts.label} reads")
    return errors


_NUMPY = {"INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64, "BOOL": np.bool_, "INT64": np.int64}
