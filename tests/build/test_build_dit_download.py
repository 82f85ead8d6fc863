"""The DiT token2wav download (Step-Audio-2-mini `token2wav/` only): patterns, verification, stage wiring.

A fake hub stands in for the network: it copies from a local repository tree exactly the files that match the
allow patterns, as the hub clients do.
"""

from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path

import pytest

from cosyvoice_build import cli, dit_weights, weights
from cosyvoice_build.pipeline import StageError, run_stages
from cosyvoice_build.settings import BuildSettings
from cosyvoice_build.stages import STAGES
import pipeline_contract as contract

RELEASED = ("flow.yaml", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2_25hz.onnx")


@pytest.fixture(scope="module")
def fake_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A hub repository tree: token2wav/ (a micro DiT model + placeholder ONNX files) and files we must not fetch."""
    from cosyvoice2.testing.dit import write_dit_model

    repo = tmp_path_factory.mktemp("Step-Audio-2-mini")
    token2wav = write_dit_model(repo / "token2wav")
    (token2wav / "hift.yaml").unlink()  # not a released file
    for name in ("campplus.onnx", "speech_tokenizer_v2_25hz.onnx"):
        (token2wav / name).write_bytes(b"onnx placeholder")
    (repo / "model-00001-of-00004.safetensors").write_bytes(b"the LLM: never downloaded")
    (repo / "token2wav" / "README.md").write_text("not needed")
    return repo


def hub_from(repo: Path, calls: list[tuple]) -> dict:
    def download(repo_id: str, revision: str | None, local_dir: Path, allow_patterns: list[str]) -> None:
        calls.append((repo_id, revision, local_dir, tuple(allow_patterns)))
        for path in repo.rglob("*"):
            relative = path.relative_to(repo).as_posix()
            if path.is_file() and any(fnmatch.fnmatch(relative, p) for p in allow_patterns):
                (local_dir / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, local_dir / relative)

    return {"hf": download}


def test_only_the_token2wav_files_are_fetched(fake_repo: Path, tmp_path: Path) -> None:
    calls: list[tuple] = []
    settings = BuildSettings(work_dir=tmp_path, token2wav="dit", dit_revision="abc123")
    directory = dit_weights.fetch_dit_token2wav(settings, hubs=hub_from(fake_repo, calls))
    assert directory == tmp_path / "Step-Audio-2-mini" / "token2wav"
    assert sorted(p.name for p in directory.iterdir()) == sorted(RELEASED)
    assert [p.name for p in (tmp_path / "Step-Audio-2-mini").iterdir()] == ["token2wav"]
    assert calls == [("stepfun-ai/Step-Audio-2-mini", "abc123", tmp_path / "Step-Audio-2-mini",
                      tuple(f"token2wav/{name}" for name in RELEASED))]


def test_fetched_files_load_as_a_dit_token2wav(fake_repo: Path, tmp_path: Path) -> None:
    from cosyvoice2.dit.loading import load_dit_flow

    settings = BuildSettings(work_dir=tmp_path, token2wav="dit")
    directory = dit_weights.fetch_dit_token2wav(settings, hubs=hub_from(fake_repo, []))
    flow = load_dit_flow(directory)
    assert flow.config.encoder.width == 32


def test_verification_names_each_problem(fake_repo: Path, tmp_path: Path) -> None:
    directory = tmp_path / "token2wav"
    shutil.copytree(fake_repo / "token2wav", directory)
    dit_weights.verify_dit_dir(directory)
    (directory / "campplus.onnx").unlink()
    (directory / "hift.pt").write_bytes(b"")
    (directory / "flow.pt").write_bytes(b"truncated")
    (directory / "flow.yaml").write_text((directory / "flow.yaml").read_text().replace("decoder_dit.DiT", "decoder.X"))
    with pytest.raises(StageError) as error:
        dit_weights.verify_dit_dir(directory)
    message = str(error.value)
    for expected in ("campplus.onnx: missing", "hift.pt: empty", "flow.pt: not a torch.save archive",
                     "flow.yaml: not a DiT token2wav flow.yaml"):
        assert expected in message
    with pytest.raises(StageError, match="does not exist"):
        dit_weights.verify_dit_dir(tmp_path / "nowhere")


def test_local_dit_dir_is_verified_not_downloaded(fake_repo: Path, tmp_path: Path) -> None:
    settings = BuildSettings(work_dir=tmp_path, token2wav="dit", dit_source="local",
                             dit_local_dir=fake_repo / "token2wav")
    assert dit_weights.fetch_dit_token2wav(settings, hubs={}) == fake_repo / "token2wav"
    with pytest.raises(ValueError, match="--dit-dir"):
        BuildSettings(dit_source="local")


def test_download_stage_fetches_the_dit_files_when_selected(fake_repo: Path, micro_model_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []
    monkeypatch.setitem(weights.HUB_DOWNLOADS, "hf", hub_from(fake_repo, calls)["hf"])
    download = [s for s in STAGES if s.name == "download"]
    unet = BuildSettings(work_dir=tmp_path, model_source="local", model_dir=micro_model_dir)
    assert [r.outcome for r in run_stages(download, unet)] == ["done"]
    assert calls == [] and not (tmp_path / "Step-Audio-2-mini").exists()
    dit = BuildSettings(work_dir=tmp_path, model_source="local", model_dir=micro_model_dir, token2wav="dit")
    assert [r.outcome for r in run_stages(download, dit)] == ["done"]  # new inputs: runs again
    assert len(calls) == 1 and (dit.dit_dir / "flow.pt").is_file()
    assert [r.outcome for r in run_stages(download, dit)] == ["skipped"]


def test_cli_options_and_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("COSYVOICE_TOKEN2WAV", "dit")
    monkeypatch.setenv("COSYVOICE_DIT_REVISION", "r1")
    args = cli.build_parser().parse_args(["--work-dir", str(tmp_path), "--dit-source", "local", "--dit-dir", "/m/t2w"])
    settings = cli.settings_from_args(args)
    assert (settings.token2wav, settings.dit_source, settings.dit_revision) == ("dit", "local", "r1")
    assert settings.dit_dir == Path("/m/t2w")
    assert cli.settings_from_args(cli.build_parser().parse_args([])).dit_model_id == "stepfun-ai/Step-Audio-2-mini"


def test_the_render_stage_serves_the_downloaded_dit_token2wav(fake_repo: Path, micro_model_dir: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """What the download stage fetched and verified is what the rendered repository's token2wav loads."""
    monkeypatch.setitem(weights.HUB_DOWNLOADS, "hf", hub_from(fake_repo, [])["hf"])
    stages = [s for s in STAGES if s.name in ("download", "render")]
    settings = BuildSettings(work_dir=tmp_path, model_source="local", model_dir=micro_model_dir, llm_backend="torch",
                             triton_layout="colocated", token2wav="dit")
    assert [r.outcome for r in run_stages(stages, settings)] == ["done", "done"]
    config = (settings.triton_repo_dir / contract.STREAMING_MODEL / "config.pbtxt").read_text()  # the engine's
    assert 'key: "token2wav" value: { string_value: "dit" }' in config
    assert f'key: "dit_dir" value: {{ string_value: "{settings.dit_dir.resolve()}" }}' in config
    unet = BuildSettings(work_dir=tmp_path / "unet", model_source="local", model_dir=micro_model_dir,
                         llm_backend="torch", triton_layout="colocated")
    assert [r.outcome for r in run_stages(stages, unet)] == ["done", "done"]
    assert 'string_value: "unet"' in (unet.triton_repo_dir / contract.STREAMING_MODEL / "config.pbtxt").read_text()
