# Triton + TensorRT-LLM image for the CosyVoice2 pipeline: serves the rendered model repository and, as the
# compose `build` service, runs cosyvoice-build (TensorRT-LLM is only available in NVIDIA's image).
# Build context: the repository root (docker compose does this; see docs/deploy.md).
FROM nvcr.io/nvidia/tritonserver:25.06-trtllm-python-py3

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONIOENCODING=utf-8

WORKDIR /opt/cosyvoice-serve
COPY . .
# The image's own torch, TensorRT-LLM and numpy satisfy the engine extra; pip only adds what is missing.
RUN python3 -m pip install ".[engine]"

# Weights, engines and the rendered repository live in the `models` volume (compose), never in the image.
ENV COSYVOICE_WORK_DIR=/models
VOLUME ["/models"]
EXPOSE 8000 8001 8002
# Refuse an engine built for another GPU or TensorRT-LLM version before serving it (compose uses the same command);
# triton_repo.launch adds the serving arguments and execs tritonserver.
CMD ["python3", "-m", "cosyvoice_build.check_engine", "--", "python3", "-m", "triton_repo.launch", "--model-repository=/models/triton_repo/trtllm_single"]
