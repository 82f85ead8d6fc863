"""CosyVoice2 LLM: Qwen2 body, speech head, sampling and decoding."""
