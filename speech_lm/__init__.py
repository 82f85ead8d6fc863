"""The speech-language-model runtime every engine's LLM runs on (docs/speech-lm.md).

What belongs to no single model: the Qwen2 body (`qwen2`, `config`), its fused kernels (`kernels`), the batched
decoder with its static KV cache and CUDA step graphs (`decode`), sampling (`sampling`), CUDA-graph capture and
shape-bucket helpers (`graph_buckets`), strict checkpoint loading (`checkpoints`) and a Qwen2 tokenizer stand-in
for tests (`testing`). A model package (`cosyvoice2`, `cosyvoice3`, `spark_tts`) provides the rest: its output
head and vocabulary, how it embeds its prefix, and its sampling parameters.

Import-light on purpose: `speech_lm.config` and `speech_lm.testing` are torch-free, so nothing here imports torch
at package import time; import the submodules directly.
"""
