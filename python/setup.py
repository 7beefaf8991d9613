"""Build hook of the kvforge Python package: bundle the built libkvforge.

`pip install ./python` (and `pip wheel ./python`) runs this. It puts
libkvforge.so, and every shared library it needs that is not part of the base
system (on Debian: liblua5.4.so.0, libxxhash.so.0, libjansson.so.4), into the
package as kvforge/_lib/. libkvforge.so carries an rpath of $ORIGIN, so the
copies beside it are the ones the loader takes: the installed package needs
neither the Debian packages nor LD_LIBRARY_PATH.

Where the library comes from:

  $KVFORGE_BUILD_DIR   a directory holding a built libkvforge.so (e.g. out/lib): used as it is
  otherwise            the source tree around python/: `make lib` is run there first (it
                       builds out/lib/libkvforge.so, or does nothing when it is up to date)

There is no pure-Python install: without a library the build stops here with
a message, rather than installing a package whose first call fails.
Everything else is in pyproject.toml.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# Libraries every Linux system provides (the manylinux policies' base set, of
# which libkvforge uses libc, libm and libdl): never bundled.
SYSTEM_LIBS = re.compile(r"^(libc|libm|libdl|libpthread|librt|libutil|libgcc_s|libstdc\+\+|libcrypt|"
                         r"libnsl|libresolv|ld-linux(-x86-64|-aarch64)?|linux-vdso|linux-gate)\.so")
# What libkvforge links besides those (Makefile SHARED_DEPS), for systems without ldd.
KNOWN_DEPS = ("liblua5.4.so.0", "libxxhash.so.0", "libjansson.so.4")


def fail(msg):
    raise SystemExit("kvforge: " + msg)


def build_dir() -> Path:
    """The directory holding libkvforge.so, building it first from the source tree."""
    env = os.environ.get("KVFORGE_BUILD_DIR")
    if env:
        d = Path(env).resolve()
        if not (d / "libkvforge.so").is_file():
            fail(f"KVFORGE_BUILD_DIR={env} holds no libkvforge.so (build it with `make lib`)")
        return d
    if not (REPO / "Makefile").is_file() or not (REPO / "include" / "kvforge.h").is_file():
        fail(f"no libkvforge to bundle: {HERE} is not inside a kvforge source tree, and "
             "KVFORGE_BUILD_DIR is not set. Build the library (`make lib` in the source tree) and "
             "install from there (`pip install ./python`), or set KVFORGE_BUILD_DIR to the "
             "directory holding libkvforge.so.")
    make = os.environ.get("MAKE", "make")
    if shutil.which(make) is None:
        fail(f"building libkvforge needs `{make}` and a C compiler (Debian: apt-get install make gcc "
             "liblua5.4-dev libxxhash-dev libjansson-dev; `make setup` in the source tree installs "
             "them); or set KVFORGE_BUILD_DIR to a directory holding a built libkvforge.so")
    print(f"kvforge: {make} -C {REPO} lib", flush=True)
    r = subprocess.run([make, "-C", str(REPO), "lib"])
    if r.returncode != 0:
        fail(f"`{make} -C {REPO} lib` failed (exit {r.returncode}): see its output above. Its "
             "build dependencies on Debian: make gcc liblua5.4-dev libxxhash-dev libjansson-dev "
             "(`make setup` installs them).")
    d = REPO / os.environ.get("O", "out") / "lib"
    if not (d / "libkvforge.so").is_file():
        fail(f"`make lib` left no {d / 'libkvforge.so'}")
    return d


def dependencies(lib: Path) -> list:
    """(soname, path) of the non-system shared libraries lib needs (ldd: transitive, resolved)."""
    if shutil.which("ldd") is None:
        found = []
        for name in KNOWN_DEPS:
            for d in (lib.parent, Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib")):
                if (d / name).is_file():
                    found.append((name, d / name))
                    break
            else:
                fail(f"{lib} needs {name}, which is neither beside it nor in the system's library "
                     "directories (and there is no ldd to ask)")
        return found
    r = subprocess.run(["ldd", str(lib)], capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"ldd {lib} failed: {r.stderr.strip()}")
    out = []
    for line in r.stdout.splitlines():
        m = re.match(r"\s*(\S+)\s+=>\s+(.*?)\s+\(0x[0-9a-f]+\)\s*$", line)
        if m is None:
            if "not found" in line:
                fail(f"{lib} needs {line.split()[0]}, which the loader cannot find: install it "
                     "(Debian: liblua5.4-0, libxxhash0, libjansson4) or put it beside the library")
            continue
        name, path = m.group(1), m.group(2)
        if name.startswith("libkvforge") or SYSTEM_LIBS.match(name):
            continue
        out.append((name, Path(path)))
    return out


class BuildPyWithLib(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / "kvforge" / "_lib"
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        lib = build_dir() / "libkvforge.so"
        # Each dependency under its soname (what DT_NEEDED names), symlinks followed.
        for name, f in [(lib.name, lib)] + dependencies(lib):
            dst = target / name
            shutil.copy2(f.resolve(), dst)
            print(f"kvforge: bundled {f} -> {dst}")


class PlatformDistribution(Distribution):
    # A wheel holding a shared library is specific to the platform, not "any".
    def has_ext_modules(self):
        return True


cmdclass = {"build_py": BuildPyWithLib}

try:
    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel as _bdist_wheel


class BdistWheelPlatform(_bdist_wheel):
    # No extension module is built: any Python 3, this platform (`make wheel`
    # runs auditwheel, which replaces linux_x86_64 by the manylinux tag it checked).
    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


cmdclass["bdist_wheel"] = BdistWheelPlatform

setup(cmdclass=cmdclass, distclass=PlatformDistribution)
