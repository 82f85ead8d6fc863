"""CosyVoice2's decoding defaults (docs/reference/cosyvoice2.md#ras-sampling and #decoding-and-stop-rules), written
once. Torch-free: the engine's requests (`cosyvoice2.llm.request.CosyVoice2Sampling`), the orchestrator's request
(`speech_serving.orchestrator.SamplingConfig`), the LLM request tensors' fallbacks (`triton_repo.internal_io`)
and the converted checkpoint's generation config (`cosyvoice_build.hf_llm`) all read them here.
"""

from __future__ import annotations

#: Nucleus sampling: keep at most TOP_K ids, while the running probability before an id is below TOP_P.
TOP_K = 25
TOP_P = 0.8
TEMPERATURE = 1.0
#: Repetition-aware sampling: redraw an id seen at least WIN_SIZE x TAU_R times among the last WIN_SIZE tokens.
WIN_SIZE = 10
TAU_R = 0.1
#: Speech tokens per target text token: EOS is masked below the minimum, the request stops at the maximum.
MIN_TOKEN_TEXT_RATIO = 2.0
MAX_TOKEN_TEXT_RATIO = 20.0
