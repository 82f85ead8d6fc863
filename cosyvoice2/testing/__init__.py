"""Test, benchmark and demo stand-ins (need torch): random-weight model directories in the official layout
here; ONNX frontend models (`frontend_models`) and DiT directories (`dit`) in the submodules (the tiny Qwen2
tokenizer is the runtime's, `speech_lm.testing`)."""

from cosyvoice2.testing.models import tiny_config, write_full_size_random_model, write_model_dir, write_tiny_model

__all__ = ["tiny_config", "write_full_size_random_model", "write_model_dir", "write_tiny_model"]
