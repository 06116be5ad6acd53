"""Builds the smoe Python package. The package ships libsmoe.so next to its
modules: it takes $SMOE_LIBRARY if set, else <repository>/build/libsmoe.so,
and runs `make lib` in the repository first when that is missing (set
SMOE_CUDA=0 in the environment for a CPU-only library; by default the
Makefile builds the CUDA backends where nvcc exists)."""
import os
import shutil
import subprocess

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def find_or_build_library():
    path = os.environ.get("SMOE_LIBRARY")
    if path:
        if not os.path.exists(path):
            raise RuntimeError("SMOE_LIBRARY=%s does not exist" % path)
        return path
    path = os.path.join(ROOT, "build", "libsmoe.so")
    if not os.path.exists(path):
        if not os.path.exists(os.path.join(ROOT, "Makefile")):
            raise RuntimeError("libsmoe.so: no %s and no Makefile in %s to build it; set "
                               "SMOE_LIBRARY" % (path, ROOT))
        subprocess.check_call(["make", "-C", ROOT, "lib"])
    return path


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        lib = find_or_build_library()
        dst = os.path.join(self.build_lib, "smoe", "libsmoe.so")
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(lib, dst)


class BinaryDistribution(Distribution):
    """The wheel holds a shared library: tag it for this platform."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithLibrary}, distclass=BinaryDistribution)
