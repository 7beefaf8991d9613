# `make data`: the real footage of the world-model evaluation (eval/worldmodel/).
# Included from the Makefile (`include eval/data.mk`); needs O and WM_PYTHON from it.
#
# Debian's opencv-doc ships vtest.avi (768x576, 795 frames, 10 fps, pedestrians,
# fixed camera). It is fetched with `apt-get download` (run `make setup` or
# `apt-get update` first), unpacked with `dpkg -x`, checked against its sha256 and
# converted by eval/worldmodel/frames.py (OpenCV from PyPI's
# opencv-python-headless) to $(O)/data/vtest_frames.npz: uint8 RGB frames
# [795, 240, 416, 3] (rows 40..482 of the source, resized with INTER_AREA), the
# last 20% (frames 636..794) held out. Nothing else is downloaded.
WM_DATA := $(O)/data
OPENCV_DOC_AVI := usr/share/doc/opencv-doc/examples/data/vtest.avi
VTEST_SHA256 := 45cddc9490be69345cbdab64ca583be65987e864ca408038e648db99e10516cf

.PHONY: data

data: $(WM_DATA)/vtest_frames.npz

$(WM_DATA)/vtest.avi:
	@mkdir -p $(WM_DATA)/deb
	rm -rf $(WM_DATA)/deb/* $(WM_DATA)/pkg
	cd $(WM_DATA)/deb && apt-get download -o APT::Sandbox::User=root opencv-doc
	dpkg -c $(WM_DATA)/deb/opencv-doc_*.deb | grep './$(OPENCV_DOC_AVI)$$' >/dev/null || \
		{ echo "opencv-doc has no $(OPENCV_DOC_AVI)"; exit 1; }
	dpkg -x $(WM_DATA)/deb/opencv-doc_*.deb $(WM_DATA)/pkg
	cp $(WM_DATA)/pkg/$(OPENCV_DOC_AVI) $@.tmp
	rm -rf $(WM_DATA)/pkg $(WM_DATA)/deb
	echo "$(VTEST_SHA256)  $@.tmp" | sha256sum -c --quiet || \
		{ echo "vtest.avi: unexpected sha256 (a different opencv-doc?)"; rm -f $@.tmp; exit 1; }
	mv $@.tmp $@

$(WM_DATA)/vtest_frames.npz: $(WM_DATA)/vtest.avi eval/worldmodel/frames.py
	$(WM_PYTHON) eval/worldmodel/frames.py $< $@.tmp.npz
	mv $@.tmp.npz $@

# The world-model tests (eval/worldmodel/tests): those needing torch skip without it;
# the peer harness and frontier tests (eval/peer/tests) run fake peers on the CPU.
.PHONY: wm-test
wm-test:
	$(WM_PYTHON) -m pytest -q eval/worldmodel/tests
	O=$(O) $(WM_PYTHON) -m pytest -q -rs eval/peer/tests

# `make wm-train-large` (GPU, about 5 minutes on one H200): retrain the large world
# model (eval/worldmodel/model.py PRESETS["large"]: 8 layers, 8 query heads over 2 KV
# heads) with train.py's recipe for that preset (seed 1234, its time budget: 200 s of
# training planned, 230 s at most), from the frames of `make data`, into
# $(WM_LARGE_DIR): weights_large.safetensors (fp16; shards beside it if it ever
# outgrows 16 MiB) and train_report_large.json (recipe, steps done, sha256 of every
# weight file, held-out error against copy-the-last-frame and the small model).
# On the GPU machine: `make wm-train-large WM_PYTHON=python3` (or tools/gpu/testbed.sh train).
WM_LARGE_DIR ?= eval/worldmodel
.PHONY: wm-train-large
wm-train-large: $(WM_DATA)/vtest_frames.npz
	$(WM_PYTHON) eval/worldmodel/train.py --preset large --frames $< --out-dir $(WM_LARGE_DIR) \
		--weights-name weights_large.safetensors --report-name train_report_large.json
