"""The check for CUDA libraries of one family loaded from two directories (`triton_repo.cuda_libraries`), on memory
maps as the GPU machines' engine processes had them."""

from __future__ import annotations

import logging

from triton_repo.cuda_libraries import check_cuda_libraries, library_dirs, mixed_libraries

WHEELS = "/opt/torch/.venv/lib/python3.12/site-packages"


def _maps(*paths: str) -> str:
    lines = [f"7f{i:010x}000-7f{i:010x}fff r-xp 00000000 fd:01 {1000 + i}    {path}" for i, path in enumerate(paths)]
    lines.append("7ffd0000000-7ffd0021000 rw-p 00000000 00:00 0                          [stack]")
    lines.append("7ffe0000000-7ffe0001000 rw-p 00000000 00:00 0 ")
    return "\n".join(lines) + "\n"


# the engine's stub with Python's LIBDIR (/usr/lib/x86_64-linux-gnu) on its LD_LIBRARY_PATH
SHADOWED = _maps(
    f"{WHEELS}/torch/lib/libtorch_cuda.so",
    f"{WHEELS}/nvidia/cudnn/lib/libcudnn.so.9",
    "/usr/lib/x86_64-linux-gnu/libcudnn_engines_precompiled.so.9.14.0",
    "/usr/lib/x86_64-linux-gnu/libcudnn_graph.so.9.14.0",
    f"{WHEELS}/nvidia/cu13/lib/libcublas.so.13",
    f"{WHEELS}/nvidia/cu13/lib/libcublasLt.so.13",
    f"{WHEELS}/nvidia/cu13/lib/libcudart.so.13",
    f"{WHEELS}/nvidia_pytriton.libs/libcudart-09529672.so.12.6.77",  # the stub's own runtime: another version
)
# the same process after the fix: every cuDNN library from the wheel
CLEAN = SHADOWED.replace("/usr/lib/x86_64-linux-gnu/", f"{WHEELS}/nvidia/cudnn/lib/")


def test_a_family_loaded_from_the_wheel_and_the_system_is_mixed():
    assert mixed_libraries(SHADOWED) == {
        ("cudnn", 9): sorted(["/usr/lib/x86_64-linux-gnu", f"{WHEELS}/nvidia/cudnn/lib"]),
    }


def test_one_directory_per_family_and_version_is_not_and_other_major_versions_are_other_libraries():
    assert mixed_libraries(CLEAN) == {}
    dirs = library_dirs(CLEAN)
    assert dirs[("cudart", 13)] == {f"{WHEELS}/nvidia/cu13/lib"}
    assert dirs[("cudart", 12)] == {f"{WHEELS}/nvidia_pytriton.libs"}  # a mangled name keeps family and version
    assert dirs[("cublas", 13)] == {f"{WHEELS}/nvidia/cu13/lib"}  # libcublasLt is of the family
    assert not any(family == "torch_cuda" for family, _ in dirs)


def test_the_check_warns_naming_the_directories_and_reads_nothing_it_cannot(tmp_path, caplog):
    maps = tmp_path / "maps"
    maps.write_text(SHADOWED)
    logger = logging.getLogger("test-cuda-libraries")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        assert check_cuda_libraries(logger, maps) == mixed_libraries(SHADOWED)
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "libcudnn (version 9)" in message and "/usr/lib/x86_64-linux-gnu" in message and "LD_LIBRARY_PATH" in message
    caplog.clear()
    maps.write_text(CLEAN)
    assert check_cuda_libraries(logger, maps) == {} and not caplog.records
    assert check_cuda_libraries(logger, tmp_path / "absent") == {}


def test_this_process_loads_no_family_from_two_places():
    """Whatever this machine's torch loaded (a CPU build: nothing of CUDA; a GPU machine: its wheels)."""
    import torch  # noqa: F401 - what the serving processes import

    assert check_cuda_libraries(logging.getLogger("test-cuda-libraries")) == {}
