# The commands a new user needs: `make run` (the service; `make weights` first fetches the CosyVoice2 weights),
# `make demo` (the whole stack on a tiny random model, no weights: its audio is noise) and `make test` (the tests).
#
# Two installs into one venv: `make run` / `make demo` / `make weights` install only what the stack runs
# (`.[engine,triton]`, torch from TORCH_INDEX: the CPU build by default, about 390 MB to download);
# `make test` adds the test tools (`dev`: browsers' drivers, fuzzers, client libraries) from PyPI alone.
# A CUDA machine: `make run TORCH_INDEX=` takes PyPI's torch (CUDA on Linux), or name the CUDA index of your choice.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_INDEX_ARG := $(if $(strip $(TORCH_INDEX)),--extra-index-url $(TORCH_INDEX))

.PHONY: venv runtime run demo weights test clean

# The runtime: what `make run` and `make demo` need, nothing for tests.
runtime: $(VENV)/.runtime

$(VENV)/.runtime: pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt $(TORCH_INDEX_ARG) -e '.[engine,triton]'
	touch $@

# Everything the tests need (CI runs `make test` on a fresh clone); includes the runtime.
venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[engine,triton,dev]'
	touch $@ $(VENV)/.runtime

run: runtime
	$(PY) -m triton_repo.local_stack

demo: runtime
	$(PY) -m triton_repo.local_stack --demo

# The download stage of the build tool: the ~3 GB the engine reads, into models/CosyVoice2-0.5B (make run's default).
weights: runtime
	$(PY) -m cosyvoice_build --work-dir models --from download --to download

test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
