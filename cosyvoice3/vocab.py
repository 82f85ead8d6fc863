"""The merged LLM vocabulary of CosyVoice3 (torch-free): what the converted Hugging Face / TensorRT-LLM checkpoint
reads and emits, and the flat ids the orchestrators and the LLM models exchange::

    [0, T)                 text rows (T = the Qwen2 text embedding's 151936 rows; the tokenizer ends at 151930)
    T + k, k < 6561        speech token k                      <|s_k|>
    T + 6561 + i, i < 200  the special ids of `speech_embedding`: sos, eos, task, fill, then 196 unused
    up to a multiple of 128  padding (158697 rows -> 158720)

Unlike CosyVoice2's layout (`cosyvoice2.vocab`), sos and task are rows of the speech table, so they sit among the
special ids; every special id ends a request.
"""

from __future__ import annotations

from dataclasses import dataclass

from cosyvoice2.vocab import SpeechVocabLayout

#: The released Qwen2 text embedding's rows: where the speech block starts.
TEXT_EMBEDDING_ROWS = 151936
NUM_SPECIAL_TOKENS = 200
#: Token names of the first four special ids, in order (the other 196 are `<|special_i|>`).
SPECIAL_TOKEN_NAMES = ("<|sos|>", "<|eos|>", "<|task_id|>", "<|fill|>")


@dataclass(frozen=True)
class CosyVoice3VocabLayout(SpeechVocabLayout):
    """`SpeechVocabLayout` with CosyVoice3's 200 special ids after the speech tokens. `end_ids` lists all of them in
    id order (sos, eos, task, fill, ...), sos first: sos is the id the reference masks below the minimum length, so it is the request's `end_id` and
    the other 199 are its stop words."""

    text_vocab_size: int = TEXT_EMBEDDING_ROWS
    num_special_tokens: int = NUM_SPECIAL_TOKENS

    @property
    def num_speech_classes(self) -> int:
        """Rows of `llm_decoder` / `speech_embedding`: speech tokens plus the special ids."""
        return self.speech_token_size + self.num_special_tokens

    @property
    def end_ids(self) -> tuple[int, ...]:
        first = self.speech_offset + self.speech_token_size
        return tuple(range(first, first + self.num_special_tokens))

    @property
    def sos_id(self) -> int:
        return self.end_ids[0]

    @property
    def task_id_id(self) -> int:
        return self.end_ids[2]

    @property
    def vocab_size(self) -> int:
        return self.speech_offset + self.num_speech_classes


def special_token_name(i: int) -> str:
    """The token name of special id `i` (0-based among the 200)."""
    return SPECIAL_TOKEN_NAMES[i] if i < len(SPECIAL_TOKEN_NAMES) else f"<|special_{i}|>"
