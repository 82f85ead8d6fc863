"""Convert a CosyVoice2 or CosyVoice3 ``llm.pt`` + ``CosyVoice-BlankEN`` into a plain Hugging Face
``Qwen2ForCausalLM`` directory; a directory holding ``cosyvoice3.yaml`` is converted as a CosyVoice3 release.

This is the checkpoint TensorRT-LLM's Qwen converter reads: one extended vocabulary holds text and speech
(CosyVoice2: upstream ``yuekai/cosyvoice2_llm`` layout, docs/reference/cosyvoice2.md#llm-as-a-plain-hugging-face-checkpoint,
see ``vocab_layout``; CosyVoice3: ``cosyvoice3.vocab``, docs/cosyvoice3.md).

CosyVoice2: embedding rows come from ``embed_tokens`` (text), ``speech_embedding`` (speech + end ids) and
``llm_embedding`` (sos, task_id); ``lm_head`` is ``llm_decoder`` on the 6564 speech/end rows and zero elsewhere.
CosyVoice3: text rows from ``embed_tokens`` (all 151936), speech and the 200 special rows (sos and task among them)
from ``speech_embedding``; ``lm_head`` is the bias-free ``llm_decoder`` on those 6761 rows and zero elsewhere, so
its logits bias only masks.

Masking decision. Upstream gives ``lm_head`` a bias that is -inf on every non-speech row and ``llm_decoder.bias``
on the speech rows. Neither HF's ``Qwen2ForCausalLM`` nor TensorRT-LLM's ``QWenForCausalLM`` has an lm_head bias
(TRT-LLM builds it as ``ColumnLinear(bias=False)``), so that bias is silently dropped: text ids get logit 0 and
could be sampled, and speech logits lose ``llm_decoder.bias``. No weight can encode it either (the final hidden
state has no constant channel). We therefore ship the bias as a separate vector, ``logits_bias.safetensors``
(float32, one entry per vocabulary row), that every runtime adds to the logits before sampling: TensorRT-LLM
takes it per request as ``embedding_bias`` (an input of Triton's ``tensorrt_llm`` model), HF as a logits
processor. Masked rows hold ``MASKED_LOGIT_BIAS``, a large *finite* value: after the softmax their probability
is exactly 0 in fp32, and unlike -inf it cannot turn into NaN in kernels that subtract or scale logits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from cosyvoice2.llm import sampling_defaults
from cosyvoice2.text.tokenizer import ADDITIONAL_SPECIAL_TOKENS, ENDOFTEXT, TOKENIZER_SUBDIR
from cosyvoice3 import layout as cosyvoice3_layout
from cosyvoice3.vocab import CosyVoice3VocabLayout, special_token_name
from cosyvoice_build.vocab_layout import (
    CHAT_TEMPLATE,
    END_TOKENS,
    LAYOUT_FILE,
    LOGITS_BIAS_FILE,
    LOGITS_BIAS_KEY,
    MASKED_LOGIT_BIAS,
    SOS_TOKEN,
    TASK_ID_TOKEN,
    SpeechVocabLayout,
    speech_token_name,
)

_BODY_PREFIX = "llm.model.model."
_BODY_KEYS = ("speech_embedding.weight", "llm_decoder.weight", _BODY_PREFIX + "embed_tokens.weight",
              _BODY_PREFIX + "norm.weight")
_REQUIRED_KEYS = ("llm_embedding.weight", "llm_decoder.bias", *_BODY_KEYS)
#: CosyVoice3's LLM has no llm_embedding (sos and task are speech_embedding rows) and no decoder bias.
_COSYVOICE3_REQUIRED_KEYS = _BODY_KEYS
#: Names of the text rows the CosyVoice3 tokenizer leaves unused below the embedding's end (151930..151935 when
#: released), so that speech token 0 gets the id 151936 when the speech tokens are added.
TEXT_PAD_TOKEN = "<|text_pad_{}|>"


class ConversionError(ValueError):
    """The inputs of the HF conversion are missing or malformed; the message names the problem."""


def load_logits_bias(hf_dir: Path) -> torch.Tensor:
    from safetensors.torch import load_file  # noqa: PLC0415 - engine dependency

    return load_file(str(Path(hf_dir) / LOGITS_BIAS_FILE))[LOGITS_BIAS_KEY]


def is_cosyvoice3_release(model_dir: Path) -> bool:
    """A CosyVoice3 release names its model in ``cosyvoice3.yaml`` (CosyVoice2's in ``cosyvoice2.yaml``)."""
    return (Path(model_dir) / cosyvoice3_layout.MODEL_YAML).is_file()


def load_text_tokenizer(tokenizer_dir: Path, special_tokens: tuple[str, ...] = ADDITIONAL_SPECIAL_TOKENS):
    """The text tokenizer (BlankEN + the model's specials, CosyVoice2's by default) as an HF tokenizer object we
    can extend and save."""
    from transformers import AutoTokenizer  # noqa: PLC0415 - heavy import, only when converting

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens(
        {"eos_token": ENDOFTEXT, "pad_token": ENDOFTEXT, "additional_special_tokens": list(special_tokens)}
    )
    return tokenizer


def _load_llm_state(llm_pt: Path, required: tuple[str, ...] = _REQUIRED_KEYS,
                    model: str = "CosyVoice2") -> dict[str, torch.Tensor]:
    if not llm_pt.is_file():
        raise ConversionError(f"{llm_pt} is missing")
    try:
        state = torch.load(llm_pt, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for truncated/foreign files
        raise ConversionError(f"{llm_pt} is not a readable torch state dict: {exc}") from exc
    if not isinstance(state, dict):
        raise ConversionError(f"{llm_pt} holds a {type(state).__name__}, expected a state dict")
    missing = [k for k in required if k not in state]
    if missing:
        raise ConversionError(f"{llm_pt} lacks keys {missing}: is it {model}'s llm.pt?")
    return state


def _read_body_config(tokenizer_dir: Path) -> dict[str, object]:
    path = tokenizer_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConversionError(f"{path} is missing") from exc
    except json.JSONDecodeError as exc:
        raise ConversionError(f"{path} is not valid JSON: {exc}") from exc
    if config.get("model_type") != "qwen2":
        raise ConversionError(f"{path}: model_type is {config.get('model_type')!r}, expected 'qwen2'")
    return config


def _extended_weights(
    state: dict[str, torch.Tensor], layout: SpeechVocabLayout, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """HF Qwen2ForCausalLM tensors over the extended vocabulary (body copied, embed/lm_head rebuilt); CosyVoice2's
    sos and task_id rows come from ``llm_embedding`` (CosyVoice3 has none: they are ``speech_embedding`` rows)."""
    text_embed = state[_BODY_PREFIX + "embed_tokens.weight"]
    speech_embed = state["speech_embedding.weight"]
    decoder_w = state["llm_decoder.weight"]
    hidden = text_embed.shape[1]
    if text_embed.shape[0] < layout.text_vocab_size:
        raise ConversionError(
            f"embed_tokens has {text_embed.shape[0]} rows but the tokenizer has {layout.text_vocab_size} tokens"
        )
    for name, tensor in (("speech_embedding", speech_embed), ("llm_decoder", decoder_w)):
        if tuple(tensor.shape) != (layout.num_speech_classes, hidden):
            raise ConversionError(f"{name} has shape {tuple(tensor.shape)}, expected ({layout.num_speech_classes}, {hidden})")

    rows = layout.padded_vocab_size
    speech = slice(layout.speech_offset, layout.speech_offset + layout.num_speech_classes)
    embed = torch.zeros(rows, hidden, dtype=torch.float32)
    embed[: layout.text_vocab_size] = text_embed[: layout.text_vocab_size]
    embed[speech] = speech_embed
    if "llm_embedding.weight" in state:
        embed[layout.sos_id : layout.task_id_id + 1] = state["llm_embedding.weight"]
    lm_head = torch.zeros(rows, hidden, dtype=torch.float32)
    lm_head[speech] = decoder_w

    weights = {
        "model." + key[len(_BODY_PREFIX) :]: tensor
        for key, tensor in state.items()
        if key.startswith(_BODY_PREFIX) and key != _BODY_PREFIX + "embed_tokens.weight"
    }
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = lm_head
    return {k: v.to(dtype).contiguous() for k, v in weights.items()}


def logits_bias(state: dict[str, torch.Tensor], layout: SpeechVocabLayout) -> torch.Tensor:
    """MASKED_LOGIT_BIAS on text and padding rows; on the speech rows ``llm_decoder.bias``, or 0 without one."""
    bias = torch.full((layout.padded_vocab_size,), MASKED_LOGIT_BIAS, dtype=torch.float32)
    decoder_bias = state.get("llm_decoder.bias")
    speech = slice(layout.speech_offset, layout.speech_offset + layout.num_speech_classes)
    bias[speech] = 0.0 if decoder_bias is None else decoder_bias.float()
    return bias


def _marker_tokens(layout: SpeechVocabLayout) -> list[str]:
    """The token names of the rows after the speech tokens, in id order."""
    if isinstance(layout, CosyVoice3VocabLayout):
        return [special_token_name(i) for i in range(layout.num_special_tokens)]
    return [*END_TOKENS, SOS_TOKEN, TASK_ID_TOKEN]


def _save_tokenizer(tokenizer, layout: SpeechVocabLayout, output_dir: Path) -> None:
    """The text tokenizer with the speech and marker rows named as tokens; text rows the tokenizer leaves unused
    below the speech block get placeholder names, so that every token's id is its row."""
    padding = [TEXT_PAD_TOKEN.format(i) for i in range(len(tokenizer), layout.speech_offset)]
    new_tokens = [*padding, *(speech_token_name(k) for k in range(layout.speech_token_size)), *_marker_tokens(layout)]
    tokenizer.add_tokens(new_tokens)
    if len(tokenizer) != layout.vocab_size or tokenizer.convert_tokens_to_ids(TASK_ID_TOKEN) != layout.task_id_id:
        raise ConversionError("the tokenizer already contains some speech/marker tokens; expected plain BlankEN")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(output_dir))
    _make_tokenizer_config_portable(output_dir)


def _write_model_config(
    body_config: dict[str, object], layout: SpeechVocabLayout, dtype: torch.dtype, output_dir: Path
) -> None:
    """BlankEN's config.json with the extended vocabulary, written as plain JSON.

    Not via ``Qwen2Config.save_pretrained``: transformers 5 would rewrite ``rope_theta`` as ``rope_parameters``, which
    the transformers 4 inside the TensorRT-LLM image does not read (it would fall back to rope_theta 10000).
    """
    config = {k: v for k, v in body_config.items() if k != "transformers_version"}
    config.update(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=layout.padded_vocab_size,
        tie_word_embeddings=False,
        bos_token_id=layout.sos_id,
        eos_token_id=layout.end_ids[0],
        pad_token_id=layout.end_ids[0],
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    (output_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _make_tokenizer_config_portable(output_dir: Path) -> None:
    """Make tokenizer_config.json readable by transformers 4 and 5 alike.

    transformers 5 saves the specials as a list under ``extra_special_tokens`` (a dict in 4.x, which then fails)
    and keeps the chat template only in chat_template.jinja (unknown to older 4.x).
    """
    path = output_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    specials = config.pop("extra_special_tokens", None)
    if isinstance(specials, list):
        config["additional_special_tokens"] = specials
    elif specials is not None:
        config["extra_special_tokens"] = specials
    for key in ("backend", "is_local", "local_files_only"):
        config.pop(key, None)
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


@dataclass(frozen=True)
class _Source:
    """What one model's release gives the conversion: its LLM state, text tokenizer, merged layout and the
    sampling defaults written into generation_config.json."""

    state: dict[str, torch.Tensor]
    tokenizer: object
    layout: SpeechVocabLayout
    top_p: float
    top_k: int


def _cosyvoice2_source(model_dir: Path, body_config: dict[str, object]) -> _Source:
    state = _load_llm_state(model_dir / "llm.pt")
    tokenizer = load_text_tokenizer(model_dir / TOKENIZER_SUBDIR)
    layout = SpeechVocabLayout(
        text_vocab_size=len(tokenizer), speech_token_size=state["speech_embedding.weight"].shape[0] - len(END_TOKENS)
    )
    return _Source(state, tokenizer, layout, sampling_defaults.TOP_P, sampling_defaults.TOP_K)


def _cosyvoice3_source(model_dir: Path, body_config: dict[str, object]) -> _Source:
    """Speech after the text embedding's rows, whatever the tokenizer's length (`cosyvoice3.vocab`)."""
    from cosyvoice3.config import CosyVoice3Config  # noqa: PLC0415
    from cosyvoice3.errors import CosyVoice3Error  # noqa: PLC0415
    from cosyvoice3.text import SPECIAL_TOKENS  # noqa: PLC0415

    try:
        config = CosyVoice3Config.from_model_dir(model_dir).llm
    except (CosyVoice3Error, KeyError, TypeError, ValueError) as exc:
        raise ConversionError(f"{model_dir} is not a CosyVoice3 model directory: {exc}") from exc
    state = _load_llm_state(model_dir / cosyvoice3_layout.LLM_FILE, _COSYVOICE3_REQUIRED_KEYS, "CosyVoice3")
    tokenizer = load_text_tokenizer(model_dir / TOKENIZER_SUBDIR, SPECIAL_TOKENS)
    layout = CosyVoice3VocabLayout(text_vocab_size=int(body_config["vocab_size"]),
                                   speech_token_size=config.speech_token_size,
                                   num_special_tokens=config.num_special_tokens)
    if len(tokenizer) > layout.speech_offset:
        raise ConversionError(f"the tokenizer has {len(tokenizer)} tokens, more than the text embedding's "
                              f"{layout.speech_offset} rows")
    return _Source(state, tokenizer, layout, config.sampling.top_p, config.sampling.top_k)


def convert_llm_to_hf(model_dir: Path, output_dir: Path, dtype: torch.dtype = torch.float32) -> SpeechVocabLayout:
    """Write the HF checkpoint, tokenizer, logits bias and layout file into ``output_dir``; return the layout.
    A CosyVoice3 release (``is_cosyvoice3_release``) gets CosyVoice3's layout, any other directory CosyVoice2's."""
    from safetensors.torch import save_file  # noqa: PLC0415
    from transformers import GenerationConfig  # noqa: PLC0415

    model_dir, output_dir = Path(model_dir), Path(output_dir)
    read_source = _cosyvoice3_source if is_cosyvoice3_release(model_dir) else _cosyvoice2_source
    with tqdm(total=4, desc="convert llm.pt", unit="step", disable=None) as progress:
        body_config = _read_body_config(model_dir / TOKENIZER_SUBDIR)
        source = read_source(model_dir, body_config)
        state, layout = source.state, source.layout
        num_layers = int(body_config["num_hidden_layers"])
        if f"{_BODY_PREFIX}layers.{num_layers - 1}.mlp.down_proj.weight" not in state:
            raise ConversionError(f"llm.pt has fewer than the {num_layers} layers config.json declares")
        progress.update()

        output_dir.mkdir(parents=True, exist_ok=True)
        weights = _extended_weights(state, layout, dtype)
        progress.update()
        save_file(weights, str(output_dir / "model.safetensors"), metadata={"format": "pt"})
        save_file({LOGITS_BIAS_KEY: logits_bias(state, layout)}, str(output_dir / LOGITS_BIAS_FILE))
        _write_model_config(body_config, layout, dtype, output_dir)
        # Sampling defaults of the reference (RAS itself is not expressible here); every end id stops.
        GenerationConfig(
            eos_token_id=list(layout.end_ids), pad_token_id=layout.end_ids[0], do_sample=True,
            top_p=source.top_p, top_k=source.top_k, temperature=sampling_defaults.TEMPERATURE,
        ).save_pretrained(str(output_dir))
        progress.update()
        _save_tokenizer(source.tokenizer, layout, output_dir)
        (output_dir / LAYOUT_FILE).write_text(json.dumps(layout.to_json(), indent=2) + "\n")
        progress.update()
    return layout
