"""Engine-level benchmarks: one engine or one of its parts alone (no tritonserver, no gateway), each module a
command, ``python -m enginebench.<name>``: ``cosyvoice2_engine``, ``dit_token2wav``, ``spark_engine``,
``microbench`` (the engine's parts), ``t2w_phase_profile`` (one token2wav call phase by phase), ``llm_scheduler``
(the scheduler's host overhead) and ``repetition_control`` (repetition control against RAS); ``timing`` is their
GPU timer. They print numbers; whether the engines compute the right thing is tested in tests/gpu.
"""
