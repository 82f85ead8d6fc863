"""Demo mode (``TTS_DEMO=true``, set by ``make demo``): the pipeline behind the gateway runs a tiny model with
random weights, so every voice speaks noise. Client developers use it to wire up integrations without the
CosyVoice2 weights; nobody must mistake its audio for the service's speech, so the gateway labels it
everywhere a client or an operator looks:

* every HTTP response carries ``X-Demo-Model: random-weights`` (also errors, health and metrics);
* ``/v1/models`` and ``/v1/audio/models`` list ``cosyvoice2-demo-random-weights`` first (also accepted as
  ``model``, like every served id);
* the startup log shows a banner with the base URL and copy-paste curl and OpenAI SDK calls (and says that
  `model="cosyvoice3"` is there too: `make demo` serves a tiny random CosyVoice3 beside CosyVoice2);
* the playground shows a notice (it reads the header of its voice listing).
"""

from __future__ import annotations

import json
import shlex

from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEMO_MODEL_ID = "cosyvoice2-demo-random-weights"
DEMO_HEADER = "X-Demo-Model"
DEMO_HEADER_VALUE = "random-weights"
#: What the banner's examples ask for (a shipped voice through its OpenAI alias, a format every player opens).
EXAMPLE_VOICE = "alloy"
EXAMPLE_TEXT = "Hello from the demo stack!"
#: The other model `make demo` serves (random weights too), as a request names it (gateway setting cosyvoice3_models).
DEMO_COSYVOICE3_MODEL = "cosyvoice3"


class DemoLabel:
    """Adds the demo header to every HTTP response (a pure ASGI middleware: streaming passes through)."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        self._header = (DEMO_HEADER.lower().encode("latin-1"), DEMO_HEADER_VALUE.encode("latin-1"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return

        async def labelled(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self._header]}
            await send(message)

        await self._app(scope, receive, labelled)


def banner(host: str, port: int, with_api_key: bool) -> str:
    """The startup banner: what this is, the base URL, and two calls to copy."""
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host  # noqa: S104 - only displayed
    base = f"http://{shown_host}:{port}/v1"
    body = json.dumps(
        {"model": DEMO_MODEL_ID, "voice": EXAMPLE_VOICE, "input": EXAMPLE_TEXT, "response_format": "wav"}
    )
    curl = [f"curl -sS -D - {base}/audio/speech -H 'Content-Type: application/json'"]
    if with_api_key:
        curl.append('-H "Authorization: Bearer $TTS_API_KEY"')
    curl += [f"-d {shlex.quote(body)}", "-o demo.wav"]
    key = 'os.environ["TTS_API_KEY"]' if with_api_key else '"unused"'
    sdk = [
        "import os" if with_api_key else "",
        "from openai import OpenAI",
        f"client = OpenAI(base_url={json.dumps(base)}, api_key={key})",
        f"client.audio.speech.create(model={json.dumps(DEMO_MODEL_ID)}, voice={json.dumps(EXAMPLE_VOICE)},",
        f"                           input={json.dumps(EXAMPLE_TEXT)}, response_format=\"wav\").write_to_file(\"demo.wav\")",
    ]
    rule = "=" * 100
    lines = [
        rule,
        "DEMO MODE: a tiny model with RANDOM WEIGHTS, every voice speaks NOISE (for wiring up clients only).",
        f"Every response carries '{DEMO_HEADER}: {DEMO_HEADER_VALUE}'; the model list shows '{DEMO_MODEL_ID}'.",
        f"Base URL (OpenAI SDKs, Open WebUI, ...): {base}",
        "curl:",
        "  " + " \\\n    ".join(curl),
        "OpenAI SDK (Python):",
        *(f"  {line}" for line in sdk if line),
        f"CosyVoice3 (random weights too): the same calls with model={json.dumps(DEMO_COSYVOICE3_MODEL)}.",
    ]
    if with_api_key:
        lines.append("(API keys are on: export TTS_API_KEY=<one of TTS_API_KEYS> first)")
    lines.append(rule)
    return "\n".join(lines)
