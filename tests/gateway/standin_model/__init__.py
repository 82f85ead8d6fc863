"""A TEST DOUBLE of the CosyVoice2 pipeline models, for gateway tests against a real tritonserver."""
