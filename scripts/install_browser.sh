#!/usr/bin/env bash
# Headless browser for the playground test (tests/gateway/test_playground.py): Debian's chromium and its
# chromedriver (apt, needs root) and the selenium package that drives them (pip, into the given python).
# Without them the test skips and says so.
set -euo pipefail
PYTHON="${1:-python3}"
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
fi
"$PYTHON" -c "import selenium" 2>/dev/null || "$PYTHON" -m pip install -q "selenium>=4.20"
