# Python binding (python/): included by the top-level Makefile.
#   make py-setup    the virtual environment .venv with numpy, pytest, setuptools, wheel (PyPI)
#   make py-test     pytest over python/tests on the CPU (torch/GPU tests skip, saying why)
#   make py-install  pip install ./python into .venv (bundles $(O)/lib/libkvforge.so)
#   make py-example  examples/attention_layer.py (GPU; needs torch in $(PY_RUN))
# `make setup` runs py-setup, `make test` runs py-test (see README.md).
PY_VENV ?= .venv
PY_HOST ?= python3
PY := $(PY_VENV)/bin/python
PY_PACKAGES ?= numpy pytest setuptools wheel opencv-python-headless==5.0.0.93 matplotlib==3.11.2
PY_RUN ?= $(PY)

.PHONY: py-setup py-test py-install py-example

# Rebuilt when this file (its package list) changes.
$(PY_VENV)/.kvforge-setup: python/python.mk
	$(PY_HOST) -m venv $(PY_VENV)
	$(PY) -m pip install --disable-pip-version-check -q $(PY_PACKAGES)
	@touch $@

py-setup: $(PY_VENV)/.kvforge-setup

py-test: $(O)/lib/libkvforge.so $(PY_VENV)/.kvforge-setup
	KVFORGE_LIB=$(CURDIR)/$(O)/lib/libkvforge.so $(PY) -m pytest -q -rs python/tests

py-install: $(O)/lib/libkvforge.so $(PY_VENV)/.kvforge-setup
	KVFORGE_BUILD_DIR=$(CURDIR)/$(O)/lib $(PY) -m pip install --disable-pip-version-check \
		--no-build-isolation ./python

py-example: $(O)/lib/libkvforge.so
	PYTHONPATH=python KVFORGE_LIB=$(CURDIR)/$(O)/lib/libkvforge.so $(PY_RUN) examples/attention_layer.py \
		--scheme schemes/rtn_int2.lua --chunks 4

# eval/data.mk's wm-test runs in this environment unless WM_PYTHON names another.
wm-test: $(if $(filter $(PY),$(WM_PYTHON)),$(PY_VENV)/.kvforge-setup)
