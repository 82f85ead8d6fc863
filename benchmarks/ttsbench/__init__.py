"""tts-bench: load generator for the CosyVoice2 service (Triton directly, or the OpenAI gateway).

Layers, one job each: ``inputs`` (manifests -> prepared requests), ``targets`` (send one request,
yield audio pieces as they arrive), ``runner`` (concurrency, warm-up, timestamps), ``stats``, ``playback``
(stalls a listener hears) and ``report`` (pure summaries, tables, JSON), ``cli`` (argument parsing and wiring).
"""
