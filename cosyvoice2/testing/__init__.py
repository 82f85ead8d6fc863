"""Test, benchmark and demo helpers: random-weight model directories in the official layout (needs torch)."""

from cosyvoice2.testing.models import tiny_config, write_full_size_random_model, write_model_dir, write_tiny_model

__all__ = ["tiny_config", "write_full_size_random_model", "write_model_dir", "write_tiny_model"]
