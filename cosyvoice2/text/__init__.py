"""The CosyVoice2 text tokenizer (needs transformers). Normalization and segmentation, pure Python and shared with
the gateway, are `speech_text`."""
