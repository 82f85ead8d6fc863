"""Uploaded voices survive restarts, interrupted writes leave no half voice, concurrent uploads are
safe, and an upload while Triton is down is kept and prepared by the first speech request."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time

import httpx
import numpy as np
import pytest

from gateway.services.voice_store import VoiceStore
from gateway.services.voices import Voice, voice_id
from triton_repo.server import REPO_ROOT
from tests.conftest import bound_socket
from tests.gateway.voice_clips import make_clip, upload

pytestmark = pytest.mark.triton

SHIPPED = {"amy", "ben", "clara", "dave"}


def names(gateway) -> dict[str, str]:
    with gateway.http() as http:
        return {v["name"]: v["id"] for v in http.get("/v1/audio/voices").json()["voices"]}


def test_uploads_survive_a_restart(standin_backend, gateway_factory, tmp_path):
    first = gateway_factory(standin_backend.server.grpc_url, uploaded_voices_dir=tmp_path)
    with first.http() as http:
        kept = upload(http, name="Kept", audio=make_clip("mp3", 1.8), transcript="Words that are kept.").json()
        gone = upload(http, name="Gone", audio=make_clip("ogg", 1.6), transcript="Words that go.").json()
        assert http.delete(f"/v1/audio/voices/{gone['id']}").status_code == 200
    first.stop()

    second = gateway_factory(standin_backend.server.grpc_url, uploaded_voices_dir=tmp_path)
    listed = names(second)
    assert {name: listed[name] for name in set(listed) - SHIPPED} == {"Kept": kept["id"]}
    with second.http() as http:
        assert http.get(f"/v1/audio/voices/{kept['id']}").json() == kept  # same id, name and created_at
    second.client().audio.speech.create(model="tts-1", voice="kept", input="zqrestarted Hello again.")
    [record] = standin_backend.requests_tagged("zqrestarted")
    assert (record["voice_id"], record["reference_text"]) == (kept["id"], "Words that are kept.")


CRASH_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    import numpy as np
    from gateway.services.voice_store import VoiceStore
    from gateway.services.voices import Voice, voice_id

    directory, crash_point = sys.argv[1], sys.argv[2]
    samples = (0.2 * np.sin(np.arange(24_000) * 0.05)).astype(np.float32)
    voice = Voice(voice_id(samples, "Crash words."), "crashed", "Crash words.", samples, uploaded=True)
    if crash_point == "before_commit":  # the audio is in place, the metadata not yet
        VoiceStore._commit = lambda self, path, content: os._exit(17)
    else:  # the audio is written and fsynced under its temporary name, not yet renamed
        os.replace = lambda src, dst: os._exit(17)
    print(voice.id, flush=True)
    VoiceStore(Path(directory)).save(voice)
    """
)


@pytest.mark.parametrize("crash_point", ["before_commit", "before_rename"])
def test_a_crash_mid_upload_leaves_no_half_voice(standin_backend, gateway_factory, tmp_path, crash_point):
    crashed = subprocess.run(
        [sys.executable, "-c", CRASH_SCRIPT, str(tmp_path), crash_point],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert crashed.returncode == 17, crashed.stderr
    crashed_id = crashed.stdout.strip()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left and not any(name.endswith(".json") for name in left)  # the process died half-way
    for leftover in tmp_path.iterdir():  # leftovers are told from uploads in progress by their age
        os.utime(leftover, (time.time() - 3600, time.time() - 3600))

    gateway = gateway_factory(standin_backend.server.grpc_url, uploaded_voices_dir=tmp_path)
    assert "crashed" not in names(gateway)
    with gateway.http() as http:
        assert http.get(f"/v1/audio/voices/{crashed_id}").status_code == 404
        # The name is free again, and the leftovers are gone.
        assert upload(http, name="crashed", audio=make_clip("wav", 1.5)).status_code == 200
    assert sorted(p.suffix for p in tmp_path.iterdir() if not p.name.startswith(".")) == [".json", ".wav"]
    assert not [p for p in tmp_path.glob(".tmp-*")]


def test_a_damaged_voice_is_skipped_at_load(tmp_path):
    store = VoiceStore(tmp_path)
    samples = (0.2 * np.sin(np.arange(20_000) * 0.07)).astype(np.float32)
    for name, transcript in (("good", "Good words."), ("bad", "Bad words.")):
        store.save(Voice(voice_id(samples, transcript), name, transcript, samples, created_at=7, uploaded=True))
    bad_metadata = next(p for p in tmp_path.glob("*.json") if json.loads(p.read_text())["name"] == "bad")
    bad_metadata.write_text(bad_metadata.read_text().replace("Bad words.", "Edited words."))
    [loaded] = store.load()
    assert (loaded.name, loaded.transcript, loaded.created_at, loaded.uploaded) == ("good", "Good words.", 7, True)
    assert np.array_equal(loaded.samples, samples)  # stored losslessly


async def test_concurrent_uploads_are_all_kept_and_names_stay_unique(standin_backend, gateway_factory, tmp_path):
    gateway = gateway_factory(standin_backend.server.grpc_url, uploaded_voices_dir=tmp_path)
    clips = {f"parallel{i}": make_clip("flac", 1.2 + 0.1 * i) for i in range(6)}

    async def post(client: httpx.AsyncClient, name: str, audio: bytes, transcript: str) -> httpx.Response:
        files = {"name": (None, name), "transcript": (None, transcript), "audio_sample": ("a.flac", audio)}
        return await client.post("/v1/audio/voices", files=files)

    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as client:
        distinct = await asyncio.gather(*(post(client, n, a, f"Words of {n}.") for n, a in clips.items()))
        same_name = await asyncio.gather(
            *(post(client, "contested", make_clip("wav", 1.0 + 0.2 * i), f"Take {i}.") for i in range(4))
        )
    assert [r.status_code for r in distinct] == [200] * len(clips)
    assert sorted(r.status_code for r in same_name) == [200, 409, 409, 409]
    assert {r.json()["error"]["code"] for r in same_name if r.status_code == 409} == {"voice_name_taken"}
    listed = names(gateway)
    assert {n: listed[n] for n in clips} == {r.json()["name"]: r.json()["id"] for r in distinct}
    assert len(list(tmp_path.glob("*.json"))) == len(list(tmp_path.glob("*.wav"))) == len(clips) + 1
    assert {v.name for v in VoiceStore(tmp_path).load()} == {*clips, "contested"}


def test_upload_while_triton_is_down_is_kept_and_prepared_by_the_first_speech(
    standin_backend, gateway_factory, tmp_path
):
    # Triton is "down" at a port held (bound, never listening) for the test: refused, and no other process
    # (another test's tritonserver) can start serving there meanwhile.
    with bound_socket() as nobody:
        offline = gateway_factory(
            f"127.0.0.1:{nobody.getsockname()[1]}", uploaded_voices_dir=tmp_path, voice_warmup_timeout_s=5
        )
        with offline.http() as http:
            created = upload(http, name="Patient", audio=make_clip("webm", 1.7), transcript="Waiting words.")
    assert created.status_code == 200, created.text
    assert offline.metric("tts_voice_warmups_total", {"outcome": "failed"}) == 1
    assert offline.metric("tts_voice_warmups_total", {"outcome": "ok"}) == 0
    voice = created.json()["id"]
    assert [r for r in standin_backend.requests() if r["voice_id"] == voice] == []

    online = gateway_factory(standin_backend.server.grpc_url, uploaded_voices_dir=tmp_path)
    client = online.client()
    client.audio.speech.create(model="tts-1", voice="patient", input="zqpatientfirst First words.")
    client.audio.speech.create(model="tts-1", voice="patient", input="zqpatientsecond Second words.")
    [first] = standin_backend.requests_tagged("zqpatientfirst")
    [second] = standin_backend.requests_tagged("zqpatientsecond")
    assert first["voice_id"] == second["voice_id"] == voice
    assert (first["voice_cached"], second["voice_cached"]) == (False, True)  # a miss computes, then hits


def test_a_failed_write_stores_and_registers_nothing(standin_backend, gateway_factory, tmp_path, monkeypatch):
    gateway = gateway_factory(standin_backend.server.grpc_url, uploaded_voices_dir=tmp_path)

    def disk_full(self, path, content):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(VoiceStore, "_commit", disk_full)
    with gateway.http() as http:
        response = upload(http, name="unlucky", audio=make_clip("wav", 1.5))
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "server_error"
        assert "unlucky" not in names(gateway)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    monkeypatch.undo()
    with gateway.http() as http:
        assert upload(http, name="unlucky", audio=make_clip("wav", 1.5)).status_code == 200


def test_replicas_sharing_a_directory_agree_on_names(standin_backend, gateway_factory, tmp_path):
    first = gateway_factory(standin_backend.server.grpc_url, uploaded_voices_dir=tmp_path)
    second = gateway_factory(standin_backend.server.grpc_url, uploaded_voices_dir=tmp_path)
    with first.http() as http:
        created = upload(http, name="Shared", audio=make_clip("wav", 1.5), transcript="Shared words.")
    assert created.status_code == 200
    voice = created.json()
    # the other replica sees it at once (listing, lookup, speech) and refuses the name
    assert names(second)["Shared"] == voice["id"]
    with second.http() as http:
        assert http.get("/v1/audio/voices/shared").json()["id"] == voice["id"]
        taken = upload(http, name="shared", audio=make_clip("wav", 1.8), transcript="Other words.")
        same = upload(http, name="Another", audio=make_clip("wav", 1.5), transcript="Shared words.")
    assert taken.status_code == 409 and taken.json()["error"]["code"] == "voice_name_taken"
    assert same.status_code == 409 and same.json()["error"]["code"] == "voice_already_exists"
    second.client().audio.speech.create(model="tts-1", voice="shared", input="zqsharedspeech Hello.")
    [record] = standin_backend.requests_tagged("zqsharedspeech")
    assert record["voice_id"] == voice["id"]
    # a restarted replica lists the name once, for the same voice
    restarted = gateway_factory(standin_backend.server.grpc_url, uploaded_voices_dir=tmp_path)
    voices = restarted.client().get("/audio/voices", cast_to=object)["voices"]
    listed = [v for v in voices if v["name"].lower() == "shared"]
    assert listed == [{"id": voice["id"], "name": "Shared"}]
    # a deletion on one replica is seen by the others, and frees the name
    with second.http() as http:
        assert http.delete(f"/v1/audio/voices/{voice['id']}").status_code == 200
    with first.http() as http:
        assert http.get(f"/v1/audio/voices/{voice['id']}").status_code == 404
        assert upload(http, name="SHARED", audio=make_clip("wav", 1.8), transcript="New words.").status_code == 200


async def test_replicas_racing_for_one_name_give_it_to_exactly_one(standin_backend, gateway_factory, tmp_path):
    replicas = [gateway_factory(standin_backend.server.grpc_url, uploaded_voices_dir=tmp_path) for _ in range(3)]

    async def post(gateway, i: int) -> httpx.Response:
        files = {
            "name": (None, "Raced"), "transcript": (None, f"Take {i}."),
            "audio_sample": ("a.wav", make_clip("wav", 1.0 + 0.2 * i)),
        }  # fmt: skip
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as client:
            return await client.post("/v1/audio/voices", files=files)

    responses = await asyncio.gather(*(post(g, i) for i, g in enumerate(replicas * 2)))
    assert sorted(r.status_code for r in responses) == [200] + [409] * 5
    assert {v.name for v in VoiceStore(tmp_path).load()} == {"Raced"}
    assert len(list(tmp_path.glob("*.wav"))) == 1
