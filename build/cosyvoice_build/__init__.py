"""Engine-build tooling for the CosyVoice2 serving stack: weights, HF/TensorRT-LLM conversion, Triton repository.

Lives in ``build/cosyvoice_build`` (not a top-level ``build`` package, which would shadow PyPI's ``build``).
Import-light: the stages import torch, transformers or tensorrt_llm only when they run.
"""
