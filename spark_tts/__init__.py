"""Spark-TTS engine: our own BiCodec audio tokenizer and decoder, the Spark prompt builder and sampler, and the
Qwen2.5 LLM on the shared batched decoder (``cosyvoice2.llm``). No HTTP, no Triton. See docs/spark.md."""
