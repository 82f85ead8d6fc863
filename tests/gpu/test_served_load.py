"""One tritonserver on one GPU, the tiny colocated pipeline rendered for CUDA, several requests at once.

The several-GPU check (`test_layouts`) failed on H200 machines because one of its servers died, and one server on
one GPU died the same way: its stubs ran in the machine's Python, which had numpy 2 (docs/deploy.md, "Several
GPUs"). Here the server alone, on one GPU, so that such a failure is not taken for a layout's."""

from __future__ import annotations

import pytest

import pipeline_contract as contract
from tests.gpu.test_layouts import FIRST_HOP, serve_round
from tests.triton.conftest import Pipeline, settled_metrics
from triton_repo.render import RenderOptions, write_repository

#: Requests at once, in `serve_round`'s servers: 2 -> four streams and two offline requests.
LOAD = 2
ROUNDS = 3


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from cosyvoice2.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_model"))


async def test_one_tritonserver_on_a_gpu_serves_streams_and_offline_requests_at_once(
    gpus, tiny_model_dir, tmp_path, triton_server_factory
) -> None:
    options = RenderOptions(model_dir=tiny_model_dir, out=tmp_path / "repo", device="cuda", max_batch=8,
                            max_seq_len=2048, first_hop=FIRST_HOP, layout="colocated")
    repo = write_repository(options)
    server = triton_server_factory(repo, ready_timeout=300)
    pipeline = Pipeline(server=server, repo=repo, llm_model=contract.STREAMING_MODEL,
                        token2wav_model=contract.STREAMING_MODEL)
    try:
        for _ in range(ROUNDS):
            await serve_round(contract.grpc_target([server.grpc_url]), LOAD)
        metrics = await settled_metrics(pipeline)
        assert metrics.get(("token2wav_failed_total", contract.STREAMING_MODEL), 0) == 0
    except BaseException:
        print(f"--- tritonserver, last lines of its log:\n{server.log_tail(80)}")
        raise
