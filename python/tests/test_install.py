"""`pip install ./python` bundles the built library: install into a temporary
directory (offline: --no-build-isolation with the venv's setuptools and wheel)
and import it from there with no KVFORGE_LIB."""
import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import PYDIR, REPO


def _build_dir():
    if os.environ.get("KVFORGE_LIB"):
        return os.path.dirname(os.path.abspath(os.environ["KVFORGE_LIB"]))
    return str(REPO / "out" / "lib")


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None or importlib.util.find_spec("wheel") is None,
                    reason="needs setuptools and wheel in this Python (make setup installs them)")
def test_pip_install_bundles_the_library(tmp_path):
    build = _build_dir()
    if not os.path.exists(os.path.join(build, "libkvforge.so")):
        pytest.skip(f"no built library in {build} (run make)")
    target = tmp_path / "site"
    env = dict(os.environ, KVFORGE_BUILD_DIR=build, PIP_DISABLE_PIP_VERSION_CHECK="1")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                        "--no-index", "--target", str(target), str(PYDIR)],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    libdir = target / "kvforge" / "_lib"
    assert (libdir / "libkvforge.so").is_file()
    for dep in ("liblua5.4.so.0", "libxxhash.so.0", "libjansson.so.4"):
        if os.path.exists(os.path.join(build, dep)):
            assert (libdir / dep).is_file()
    env = {k: v for k, v in os.environ.items() if k not in ("KVFORGE_LIB", "KVFORGE_BUILD_DIR", "PYTHONPATH")}
    env["PYTHONPATH"] = str(target)
    code = ("import kvforge, numpy as np\n"
            "print(kvforge.__file__)\nprint(kvforge.library_path())\n"
            "c = kvforge.QuantizedKVCache('rtn_int2', 1, 2, 128)\n"
            "c.append(0, np.ones((2, 8, 128), np.float32), np.ones((2, 8, 128), np.float32))\n"
            "print(c.keys_values(0)[0].shape)\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.split("\n")
    assert lines[0].startswith(str(target)) and lines[1] == str(libdir / "libkvforge.so")
    assert lines[2] == "(2, 8, 128)"
