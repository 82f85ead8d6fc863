"""Triton model repository for the CosyVoice2 pipeline: templates, render tool, server launcher.

The gateway-facing interface these models implement is the top-level `pipeline_contract` package.
"""
