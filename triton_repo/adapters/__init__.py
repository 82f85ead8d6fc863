"""Thin Triton python-backend adapters over `speech_serving`; each rendered `model.py` imports one.

These modules import `triton_python_backend_utils`, which exists only inside tritonserver's python stub.
"""
