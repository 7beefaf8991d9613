"""Frames of vtest.avi for the world model, and patch <-> pixel helpers.

`python3 eval/worldmodel/frames.py VIDEO OUT.npz` decodes vtest.avi (Debian's
opencv-doc, examples/data/vtest.avi: 768x576, 795 frames, 10 fps, MS-MPEG4v3)
with OpenCV, crops rows [40, 483) (443 rows: the 416:240 aspect ratio of a 480p
latent grid, dropping 40 rows of building at the top and 93 of lawn at the
bottom), resizes to 416x240 with INTER_AREA and writes uint8 RGB frames
[795, 240, 416, 3] to a zip (.npz) whose entries carry a fixed date, so the
same decoded pixels give the same bytes. The last 20% of the frames
(636..794) are held out: training never reads them.

The decoded pixels depend (slightly) on the FFmpeg inside OpenCV's wheel:
OpenCV 4.10.0 and 5.0.0 differ by at most 2 levels on 0.002% of the pixels, so
the frames' sha256 is recorded (with the OpenCV version) in the file, and
train.py, dump_kv.py and rollout.py carry it into their outputs.

At 8x8 pixels per patch a frame is 30 x 52 = 1560 tokens, a chunk of 3 frames
4680 tokens: the token geometry of a 480p video model.
"""
from __future__ import annotations

import hashlib
import io
import json
import sys
import zipfile

import numpy as np

WIDTH, HEIGHT = 416, 240
CROP_Y0, CROP_Y1 = 40, 483          # rows of the 576-row source kept (443 = 768 * 240 / 416)
HELDOUT_FRACTION = 0.2
VTEST_SHA256 = "45cddc9490be69345cbdab64ca583be65987e864ca408038e648db99e10516cf"
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


def decode_video(path: str) -> np.ndarray:
    """All frames of the video, cropped and resized: uint8 RGB [F, 240, 416, 3]."""
    import cv2
    cap = cv2.VideoCapture(path)
    if not cap.isOpened():
        raise RuntimeError(f"{path}: OpenCV cannot open it")
    out = []
    while True:
        ok, bgr = cap.read()
        if not ok:
            break
        if bgr.shape[:2] != (576, 768):
            raise RuntimeError(f"{path}: frame {len(out)} is {bgr.shape[1]}x{bgr.shape[0]}, expected 768x576")
        crop = bgr[CROP_Y0:CROP_Y1]
        small = cv2.resize(crop, (WIDTH, HEIGHT), interpolation=cv2.INTER_AREA)
        out.append(small[:, :, ::-1])  # BGR -> RGB
    cap.release()
    if not out:
        raise RuntimeError(f"{path}: no frame decoded")
    return np.ascontiguousarray(np.stack(out))


def frames_sha256(frames: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(frames, dtype=np.uint8).tobytes()).hexdigest()


def save_frames(path: str, frames: np.ndarray, meta: dict, compress: bool = True) -> None:
    """A .npz (zip) with `frames` and `meta` (JSON text as a uint8 array); fixed entry dates.
    compress=False stores the arrays uncompressed (a scratch copy: written and read in a
    fraction of the time; the same frames, a larger file)."""
    def npy(a):
        b = io.BytesIO()
        np.lib.format.write_array(b, np.ascontiguousarray(a), allow_pickle=False)
        return b.getvalue()
    entries = {"frames.npy": npy(frames),
               "meta.npy": npy(np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8))}
    with zipfile.ZipFile(path, "w") as z:
        for name, data in entries.items():
            info = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
            info.external_attr = 0o644 << 16
            z.writestr(info, data, compresslevel=6 if compress else None)


def load_frames(path: str):
    """(frames uint8 [F, H, W, 3], meta dict) from save_frames' file (or a plain .npy of frames)."""
    if path.endswith(".npy"):
        fr = np.load(path)
        return fr, {"heldout_start": int(round(len(fr) * (1 - HELDOUT_FRACTION))), "source": path}
    with np.load(path, allow_pickle=False) as z:
        frames = z["frames"]
        meta = json.loads(bytes(z["meta"]).decode()) if "meta" in z else {}
    meta.setdefault("heldout_start", int(round(len(frames) * (1 - HELDOUT_FRACTION))))
    return frames, meta


def synthetic_frames(n: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """Small moving-blob video (uint8 RGB [n, height, width, 3]) for tests: a fixed textured
    background and a few squares moving at constant velocity."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    bg = np.stack([(60 + 40 * np.sin(xx / 7.0 + c) + 30 * np.cos(yy / 5.0 - c)) for c in range(3)], -1)
    blobs = [(rng.uniform(0, height), rng.uniform(0, width), rng.uniform(-2, 2), rng.uniform(-3, 3),
              rng.integers(40, 255, 3), int(rng.integers(4, 9))) for _ in range(3)]
    out = np.empty((n, height, width, 3), np.uint8)
    for t in range(n):
        f = bg.copy()
        for y0, x0, vy, vx, col, s in blobs:
            y, x = int(y0 + vy * t) % height, int(x0 + vx * t) % width
            f[max(0, y - s):y + s, max(0, x - s):x + s] = col
        out[t] = np.clip(f, 0, 255)
    return out


def main(argv):
    fast = "--fast" in argv[1:]
    argv = [x for x in argv if x != "--fast"]
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[0])
        print(f"usage: {argv[0]} [--fast] VIDEO OUT.npz   (--fast: uncompressed, for a scratch copy)")
        return 2
    src, dst = argv[1], argv[2]
    with open(src, "rb") as f:
        vsha = hashlib.sha256(f.read()).hexdigest()
    if vsha != VTEST_SHA256:
        print(f"warning: {src} sha256 {vsha} is not the vtest.avi of opencv-doc 4.6.0+dfsg-12 "
              f"({VTEST_SHA256})", file=sys.stderr)
    import cv2
    frames = decode_video(src)
    n = len(frames)
    meta = {
        "source": "vtest.avi (Debian opencv-doc, usr/share/doc/opencv-doc/examples/data/vtest.avi)",
        "video_sha256": vsha,
        "crop_rows": [CROP_Y0, CROP_Y1],
        "size": [WIDTH, HEIGHT],
        "resize": "cv2.INTER_AREA",
        "opencv": cv2.__version__,
        "channels": "RGB",
        "n_frames": n,
        "heldout_start": int(round(n * (1 - HELDOUT_FRACTION))),
        "frames_sha256": frames_sha256(frames),
    }
    save_frames(dst, frames, meta, compress=not fast)
    print(f"{dst}: {n} frames {HEIGHT}x{WIDTH} RGB uint8, held out from frame {meta['heldout_start']}, "
          f"frames sha256 {meta['frames_sha256'][:16]} (OpenCV {cv2.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
