"""OpenAI-compatible ``/v1/audio/speech`` gateway in front of the Triton CosyVoice2 pipeline."""
