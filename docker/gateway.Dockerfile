# The OpenAI-compatible gateway: slim Python, no torch, runs as a non-root user.
# Build context: the repository root (docker compose does this; see docs/deploy.md).
FROM python:3.11.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

RUN useradd --create-home --uid 10001 gateway
WORKDIR /app
COPY . .
# The base install is the gateway: its dependencies include no torch.
RUN python -m pip install . && chown -R gateway:gateway /app \
    && mkdir -p /data/voices && chown gateway:gateway /data/voices

USER gateway
ENV TTS_HOST=0.0.0.0 \
    TTS_PORT=8080 \
    TTS_VOICES_DIR=/app/ref_audios \
    TTS_UPLOADED_VOICES_DIR=/data/voices
# Uploaded voices outlive the container (compose mounts a named volume here).
VOLUME /data/voices
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=2)"]
# The same command as the README's (and `make run`'s) way to run the gateway.
CMD ["python", "-m", "gateway"]
