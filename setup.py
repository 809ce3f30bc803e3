# Only the native extension lives here; everything else is in pyproject.toml.
# libcuda is dlopen()ed at run time, so the module builds and imports with no GPU and no driver.
from glob import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "coldsnap._C",
            sorted(glob("csrc/*.cpp")),
            depends=sorted(glob("csrc/*.h")),
            cxx_std=17,
            libraries=["dl"],
            extra_compile_args=["-O2", "-Wall", "-Wextra"],
        )
    ],
    cmdclass={"build_ext": build_ext},
)
