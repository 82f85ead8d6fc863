"""stack-bench: the whole-stack benchmark. It stands up a complete stack on one machine (weights, the rendered
repository, tritonserver(s) and the gateway) and loads it level by level with the load generator, `tts-bench`
(package ``ttsbench``), reading the Triton metrics and the GPU around each level.

Modules: ``launch`` (the stack under measurement: weights, rendering, tritonservers, gateway; the soak starts the
same one) and ``cli`` (scenarios, levels, measures, tables and the results directories).

Not the local stack `make run` starts: that is ``triton_repo.local_stack``, the product's launcher.
"""
