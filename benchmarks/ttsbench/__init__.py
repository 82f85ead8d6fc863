"""tts-bench: load generator for the CosyVoice2 service (Triton directly, or the OpenAI gateway).

Layers, one job each: ``inputs`` (manifests -> prepared requests), ``targets`` (send one request,
yield audio pieces as they arrive), ``arrivals`` (open loop: seeded Poisson arrival times and request picks),
``runner`` (closed-loop concurrency or open-loop arrivals, warm-up, timestamps), ``stats``, ``playback``
(stalls a listener hears) and ``report`` (pure summaries, tables, JSON), ``ratesearch`` (the highest open-loop rate
that meets a listener's bound), ``cli`` (argument parsing and wiring).

It loads a stack that is already running; ``stackbench`` (stack-bench) is the benchmark that starts one and runs
these levels against it.
"""
