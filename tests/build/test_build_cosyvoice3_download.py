"""The ``cosyvoice3-weights`` stage: Fun-CosyVoice3-0.5B-2512 only when asked, through the real hub-client code.

Only the network boundary is replaced: ``huggingface_hub.snapshot_download`` (or ModelScope's) by a function that
copies from a repository tree on disk exactly the files matching the allow patterns, as the clients do. The
offline cases run the real ``snapshot_download`` in the hub client's own offline mode (it never opens a socket).
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_build import cli, cosyvoice3_weights, weights
from cosyvoice_build.pipeline import StageError, run_stages
from cosyvoice_build.settings import BuildSettings
from cosyvoice_build.stages import STAGES
from cosyvoice3 import layout

REPO_ID = "FunAudioLLM/Fun-CosyVoice3-0.5B-2512"
#: In the repository beside the released files; the engine never reads them, so they are never fetched.
NOT_FETCHED = ("README.md", "asset/dingding.png", f"{layout.TOKENIZER_SUBDIR}/model.safetensors")
STAGE = [s for s in STAGES if s.name == "cosyvoice3-weights"]


@pytest.fixture(scope="module")
def hub_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Hub repositories on disk: ``<root>/<repo id>/`` holds the released layout at full size (stride-0 tensors,
    a few MB) with the tokenizer and frontend files, plus files the stage must leave on the hub."""
    from cosyvoice3.testing import write_full_size_layout

    root = tmp_path_factory.mktemp("hub")
    repo = write_full_size_layout(root / REPO_ID, text_frontend=True)
    for name in NOT_FETCHED:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes(b"never downloaded")
    return root


def fake_snapshot_download(hub_root: Path, calls: list[tuple]):
    """``snapshot_download``'s keyword interface, serving ``hub_root/<repo id>`` with fnmatch allow patterns."""

    def snapshot_download(repo_id: str, revision: str | None = None, local_dir: str | None = None,
                          allow_patterns: list[str] | None = None, **_: object) -> str:
        calls.append((repo_id, revision, Path(str(local_dir)), tuple(allow_patterns or ())))
        source = hub_root / repo_id
        for path in source.rglob("*"):
            name = path.relative_to(source).as_posix()
            if path.is_file() and any(fnmatch.fnmatch(name, p) for p in allow_patterns or ["*"]):
                (Path(str(local_dir)) / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, Path(str(local_dir)) / name)
        return str(local_dir)

    return snapshot_download


@pytest.fixture()
def hub_calls(hub_root: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    import huggingface_hub

    calls: list[tuple] = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download(hub_root, calls))
    return calls


@pytest.fixture()
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real client in its offline mode (what ``HF_HUB_OFFLINE=1`` sets), its cache in the test's directory."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))


def run_cli(work_dir: Path, *options: str) -> int:
    return cli.main(["--work-dir", str(work_dir), "--from", "cosyvoice3-weights", "--to", "cosyvoice3-weights",
                     *options])


# not asked: nothing downloaded ---------------------------------------------------------------------------------
def test_nothing_is_fetched_unless_asked(hub_calls: list, micro_model_dir: Path, tmp_path: Path) -> None:
    """Defaults (command line and settings) leave CosyVoice3 alone, also in a whole CosyVoice2 download run."""
    assert cli.settings_from_args(cli.build_parser().parse_args([])).cosyvoice3_source == "off"
    assert BuildSettings().cosyvoice3_source == "off"
    assert cosyvoice3_weights.fetch_cosyvoice3_weights(BuildSettings(work_dir=tmp_path)) is None
    stages = [s for s in STAGES if s.name in ("download", "cosyvoice3-weights")]
    cosyvoice2 = BuildSettings(work_dir=tmp_path, model_source="local", model_dir=micro_model_dir)
    assert [r.outcome for r in run_stages(stages, cosyvoice2)] == ["done", "done"]
    assert run_cli(tmp_path / "cli") == 0  # the stage alone, through the command line
    assert "[cosyvoice3-weights] not requested" in (tmp_path / "cli" / ".build" / "logs" / "build.log").read_text()
    assert hub_calls == []
    assert not (tmp_path / "Fun-CosyVoice3-0.5B-2512").exists()
    assert not (tmp_path / "cli" / "Fun-CosyVoice3-0.5B-2512").exists()


# asked: the right repository, only the released files, and the engine loads them ------------------------------
def test_asked_downloads_the_release_and_the_engine_loads_it_strictly(hub_calls: list, tmp_path: Path) -> None:
    assert run_cli(tmp_path, "--cosyvoice3-source", "hf", "--cosyvoice3-revision", "r1") == 0
    target = tmp_path / "Fun-CosyVoice3-0.5B-2512"
    assert hub_calls == [(REPO_ID, "r1", target, layout.RELEASED_FILES)]
    fetched = {p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file()}
    assert fetched == set(layout.RELEASED_FILES)  # nothing of NOT_FETCHED
    import cosyvoice3

    engine = cosyvoice3.load(target)  # strict: every key of every file consumed, shapes equal
    request = engine.text_request("Hello.", reference_text="Hi.")  # the fetched tokenizer files
    assert request.mode == "zero_shot" and engine.config.llm.endofprompt_id in request.prompt_text
    voice = engine.prepare_voice((np.random.default_rng(0).normal(0, 0.1, 24000).astype(np.float32), 24000))
    assert voice.tokens.numel() == 25  # the fetched frontend models: 1 s -> 25 speech tokens
    assert run_cli(tmp_path, "--cosyvoice3-source", "hf", "--cosyvoice3-revision", "r1") == 0
    assert len(hub_calls) == 1  # up to date: skipped
    assert run_cli(tmp_path, "--cosyvoice3-source", "hf", "--cosyvoice3-revision", "r2") == 0
    assert [call[1] for call in hub_calls] == ["r1", "r2"]  # a new revision downloads again


def test_the_environment_asks_as_compose_passes_options(hub_calls: list, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COSYVOICE_COSYVOICE3_SOURCE", "hf")
    assert run_cli(tmp_path) == 0
    assert [call[0] for call in hub_calls] == [REPO_ID]


def test_modelscope_is_asked_for_the_same_repository(hub_root: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []
    fake = fake_snapshot_download(hub_root, calls)
    modelscope = types.ModuleType("modelscope")
    modelscope.snapshot_download = lambda repo_id, **kwargs: fake(repo_id, **kwargs)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "modelscope", modelscope)
    settings = BuildSettings(work_dir=tmp_path, cosyvoice3_source="modelscope")
    assert cosyvoice3_weights.fetch_cosyvoice3_weights(settings) == settings.cosyvoice3_weights_dir
    assert [call[0] for call in calls] == [REPO_ID]


def test_a_local_directory_is_verified_not_downloaded(hub_calls: list, hub_root: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--cosyvoice3-model-dir"):
        BuildSettings(cosyvoice3_source="local")
    assert run_cli(tmp_path, "--cosyvoice3-source", "local", "--cosyvoice3-model-dir", str(hub_root / REPO_ID)) == 0
    assert hub_calls == [] and not (tmp_path / "Fun-CosyVoice3-0.5B-2512").exists()


# missing or damaged files are named ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", layout.RELEASED_FILES)
def test_each_missing_file_is_named_alone(hub_root: Path, tmp_path: Path, name: str) -> None:
    model = tmp_path / "model"
    shutil.copytree(hub_root / REPO_ID, model)
    (model / name).unlink()
    with pytest.raises(StageError) as error:
        cosyvoice3_weights.verify_cosyvoice3_dir(model)
    assert str(error.value) == f"CosyVoice3 model directory {model} is incomplete: {name}: missing"


def foreign_yaml(model: Path) -> None:
    """CosyVoice2's flow class where CosyVoice3's belongs: well-formed, but not this model."""
    yaml_file = model / "cosyvoice3.yaml"
    yaml_file.write_text(yaml_file.read_text().replace("CausalMaskedDiffWithDiT", "CausalMaskedDiffWithXvec"))


@pytest.mark.parametrize(("damage", "message"), [
    (lambda d: (d / "llm.pt").write_bytes(b"\0" * 64), "llm.pt: not a torch.save archive (truncated download?)"),
    (lambda d: (d / "campplus.onnx").write_bytes(b""), "campplus.onnx: empty"),
    (lambda d: (d / "CosyVoice-BlankEN" / "config.json").write_text("{"),
     "CosyVoice-BlankEN/config.json: invalid JSON"),
    (foreign_yaml, "cosyvoice3.yaml with CosyVoice-BlankEN/config.json: not a CosyVoice3 model"),
])
def test_a_damaged_file_is_named(hub_root: Path, tmp_path: Path, damage, message: str) -> None:
    model = tmp_path / "model"
    shutil.copytree(hub_root / REPO_ID, model)
    damage(model)
    with pytest.raises(StageError, match=re.escape(message)):
        cosyvoice3_weights.verify_cosyvoice3_dir(model)


def test_an_incomplete_download_names_the_missing_file(hub_root: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub lacks a file (an older or partial upload): the stage fails naming exactly that file."""
    import huggingface_hub

    partial_root = tmp_path / "hub"
    shutil.copytree(hub_root / REPO_ID, partial_root / REPO_ID)
    (partial_root / REPO_ID / layout.SPEECH_TOKENIZER_FILE).unlink()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download(partial_root, []))
    work = tmp_path / "work"
    assert run_cli(work, "--cosyvoice3-source", "hf") == 1
    log = (work / ".build" / "logs" / "build.log").read_text()
    assert "[cosyvoice3-weights] FAILED: CosyVoice3 model directory" in log
    assert f"is incomplete: {layout.SPEECH_TOKENIZER_FILE}: missing\n" in log
    assert not (work / ".build" / "cosyvoice3-weights.done.json").exists()


# offline, or no hub client: the same messages as CosyVoice2's download -----------------------------------------
@pytest.mark.parametrize("model", ["cosyvoice2", "cosyvoice3"])
def test_offline_says_the_hub_is_unreachable_and_leaves_nothing_behind(offline_hub: None, tmp_path: Path,
                                                                        model: str) -> None:
    if model == "cosyvoice2":
        settings = BuildSettings(work_dir=tmp_path / "work", model_source="hf")
        fetch, target, repo = weights.fetch_weights, settings.weights_dir, "FunAudioLLM/CosyVoice2-0.5B"
    else:
        settings = BuildSettings(work_dir=tmp_path / "work", cosyvoice3_source="hf")
        fetch, target, repo = cosyvoice3_weights.fetch_cosyvoice3_weights, settings.cosyvoice3_weights_dir, REPO_ID
    with pytest.raises(StageError) as error:
        fetch(settings)
    message = str(error.value)
    assert message.startswith(f"cannot reach the Hugging Face hub to download {repo} (no network, or "
                              f"HF_HUB_OFFLINE is set) and {target} holds no earlier download of it")
    assert "use an existing copy as the local source" in message
    assert not target.exists()  # the failed first download removed the directory it made


def test_offline_with_an_interrupted_download_names_what_is_still_missing(offline_hub: None, hub_root: Path,
                                                                          tmp_path: Path) -> None:
    """The offline client hands back what an earlier run left; verification names every file still missing."""
    settings = BuildSettings(work_dir=tmp_path, cosyvoice3_source="hf")
    target = settings.cosyvoice3_weights_dir
    target.mkdir()
    shutil.copy(hub_root / REPO_ID / layout.LLM_FILE, target / layout.LLM_FILE)
    with pytest.raises(StageError) as error:
        cosyvoice3_weights.fetch_cosyvoice3_weights(settings)
    missing = [name for name in layout.RELEASED_FILES if name != layout.LLM_FILE]
    assert str(error.value).endswith("is incomplete: " + "; ".join(f"{name}: missing" for name in missing))
    assert (target / layout.LLM_FILE).is_file()  # kept for the next run to resume from


def test_without_huggingface_hub_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails as when it is not installed
    work = tmp_path / "work"
    assert run_cli(work, "--cosyvoice3-source", "hf") == 1
    log = (work / ".build" / "logs" / "build.log").read_text()
    assert "[cosyvoice3-weights] FAILED: huggingface_hub is not installed: pip install huggingface_hub" in log
    assert not (work / "Fun-CosyVoice3-0.5B-2512").exists()
