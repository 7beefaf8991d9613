"""Build hook of the kvforge Python package: bundle the built libkvforge.

`pip install ./python` runs this. It copies libkvforge.so, and the shared
libraries it needs when they sit beside it (liblua5.4.so.0, libxxhash.so.0,
libjansson.so.4: `make carry` puts them there), into the package as
kvforge/_lib/. libkvforge.so carries an rpath of $ORIGIN, so the copies are
found next to it. Where the build is taken from:

  $KVFORGE_BUILD_DIR      a directory holding libkvforge.so (e.g. out/lib)
  ../out/lib              relative to this file (the repository's `make` output)

Without a built library the package still installs (pure Python) and finds the
library at run time ($KVFORGE_LIB, the source tree, the loader's search); set
KVFORGE_REQUIRE_LIB=1 to make a missing library a build error instead.
Everything else is in pyproject.toml.
"""
import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
RUNTIME_DEPS = ("liblua5.4.so.0", "libxxhash.so.0", "libjansson.so.4")


def build_dir():
    env = os.environ.get("KVFORGE_BUILD_DIR")
    return Path(env).resolve() if env else HERE.parent / "out" / "lib"


def library_files():
    d = build_dir()
    lib = d / "libkvforge.so"
    if not lib.is_file():
        msg = (f"kvforge: no built library at {lib} (run `make` first, or set KVFORGE_BUILD_DIR); "
               "installing without a bundled libkvforge: set KVFORGE_LIB at run time")
        if os.environ.get("KVFORGE_REQUIRE_LIB", "") not in ("", "0"):
            raise SystemExit(msg)
        print("WARNING: " + msg)
        return []
    files = [lib]
    for dep in RUNTIME_DEPS:
        if (d / dep).is_file():
            files.append(d / dep)
    return files


class BuildPyWithLib(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / "kvforge" / "_lib"
        if target.exists():
            shutil.rmtree(target)
        files = library_files()
        if not files:
            return
        target.mkdir(parents=True)
        for f in files:
            shutil.copy2(f.resolve(), target / f.name)  # follow symlinks: real files
            print(f"kvforge: bundled {f} -> {target / f.name}")


cmdclass = {"build_py": BuildPyWithLib}

# A wheel holding a shared library is specific to the platform (not "any"), but
# not to the Python version: no extension module is built.
from setuptools.dist import Distribution


def library_present():
    return (build_dir() / "libkvforge.so").is_file()


class PlatformDistribution(Distribution):
    def has_ext_modules(self):
        return library_present()


try:
    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
except ImportError:  # setuptools < 70.1
    try:
        from wheel.bdist_wheel import bdist_wheel as _bdist_wheel
    except ImportError:
        _bdist_wheel = None

if _bdist_wheel is not None:
    class BdistWheelPlatform(_bdist_wheel):
        def get_tag(self):
            python, abi, plat = super().get_tag()
            return ("py3", "none", plat) if library_present() else (python, abi, plat)

    cmdclass["bdist_wheel"] = BdistWheelPlatform

setup(cmdclass=cmdclass, distclass=PlatformDistribution)
