"""Triton model repository for the CosyVoice2 pipeline: templates, render tool, server launcher.

Keep this package import-light (no torch): the gateway imports `triton_repo.contract`.
"""
