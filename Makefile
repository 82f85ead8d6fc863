# The commands a new user needs: `make run` (the service; `make weights` first fetches the CosyVoice2 weights),
# `make demo` (the whole stack on a tiny random model, no weights: its audio is noise) and `make test` (the tests).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: venv run demo weights test clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[engine,triton,dev]'
	touch $@

run: venv
	$(PY) -m triton_repo.stack

demo: venv
	$(PY) -m triton_repo.stack --demo

# The download stage of the build tool: the ~3 GB the engine reads, into models/CosyVoice2-0.5B (make run's default).
weights: venv
	$(PY) -m cosyvoice_build --work-dir models --from download --to download

test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
