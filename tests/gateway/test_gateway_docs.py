"""The README documents every setting the gateway reads."""

from __future__ import annotations

from gateway.settings import Settings
from triton_repo.server import REPO_ROOT


def test_readme_settings_table_lists_every_setting():
    readme = (REPO_ROOT / "README.md").read_text()
    documented = {line.split("`")[1] for line in readme.splitlines() if line.startswith("| `TTS_")}
    assert documented == {f"TTS_{name.upper()}" for name in Settings.model_fields}
