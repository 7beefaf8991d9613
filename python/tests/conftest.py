"""pytest set-up: test the package of this source tree (python/) unless
KVFORGE_TEST_INSTALLED=1 asks for the installed one."""
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PYDIR = HERE.parent
REPO = PYDIR.parent
if os.environ.get("KVFORGE_TEST_INSTALLED", "") in ("", "0"):
    sys.path.insert(0, str(PYDIR))
sys.path.insert(0, str(HERE))  # rtn_model


def pytest_report_header(config):
    try:
        import kvforge
        return f"kvforge {kvforge.__file__}, libkvforge {kvforge.library_path()}"
    except Exception as e:  # noqa: BLE001
        return f"kvforge: library not loaded ({e})"


@pytest.fixture
def rng():
    import numpy as np
    return np.random.default_rng(1234)


def video_like(rng, shape):
    """float32 K/V-like data: per-channel offsets and scales (some outlier channels)."""
    import numpy as np
    d = shape[-1]
    off = rng.normal(0, 2, d).astype(np.float32)
    scale = np.exp(rng.normal(0, 0.5, d)).astype(np.float32)
    scale[rng.choice(d, 4, replace=False)] *= 8
    return (rng.standard_normal(shape).astype(np.float32) * scale + off).astype(np.float32)


@pytest.fixture
def schemes_dir():
    return REPO / "schemes"
