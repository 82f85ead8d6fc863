"""Text frontend: tokenizer (needs transformers), normalization and segmentation (pure Python)."""
