"""Spark-TTS engine: our own BiCodec audio tokenizer and decoder, the Spark prompt builder and sampler, and the
Qwen2.5 LLM on the speech-LM runtime's batched decoder (``speech_lm``). No HTTP, no Triton. See docs/spark.md."""
