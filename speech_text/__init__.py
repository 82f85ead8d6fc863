"""Text normalization and segmentation of speech input: pure Python (stdlib + ``inflect``), no torch, no model.

The rules are CosyVoice2's frontend rules (docs/reference/cosyvoice2.md#text-normalization-and-segmentation),
shared by every layer that cuts text: the gateway segments each request with them, whatever model serves it, and
the CosyVoice2 engine normalizes and segments with them. Nothing here imports an engine, so the torch-free gateway
and either engine import it alike. Model tokenizers stay with their engines (`cosyvoice2.text.tokenizer`).
"""
