"""CosyVoice3 (Fun-CosyVoice3-0.5B-2512) engine: LLM, DiT flow and causal HiFT, offline and streaming."""
