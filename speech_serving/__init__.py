"""Serving logic for the speech pipelines (CosyVoice2, Spark-TTS), independent of Triton.

The Triton ``model.py`` files in ``triton_repo/templates`` are thin adapters over these classes:

* `orchestrator` - the per-request state machine (validate, voice prompt, LLM token stream, chunked
  token2wav, cumulative usage), written against small client protocols so it runs without Triton.
* `io_struct` - the data the serving processes hand each other (prompt tensors, LLM requests); the
  gateway-facing request and response are the pipeline contract's (`pipeline_contract`).
* `schedule` - the streaming chunk schedule, built in one place for both ends of a stream.
* `voice_cache` - bounded LRU of voice prompts keyed by voice id, single-flight on misses.
* `llm_scheduler` - continuous batching over a batched decoder with fixed KV slots.
* `token2wav` - per-request stream registry and a batcher that runs concurrent chunks in one forward.
* `spark` - the Spark-TTS orchestrator, voice tokens and colocated engine.
* `stats` - the counters and gauges every component exposes (exported as Triton metrics).
* `heap` - a serving process's heap frozen once loaded, and its garbage collector's pauses counted.

Nothing here imports tritonclient or triton_python_backend_utils; torch is imported only by the
engine adapters (`engines`).
"""
