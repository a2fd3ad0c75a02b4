"""Builds gradspec._C from csrc/ with pybind11; kernels/ ships as gradspec.kernels (package_dir:
the wheel and the editable install both map it, with no link in the tree).

LAPACK and BLAS are bound at import time from SciPy's function pointers, so the
build needs neither their headers nor torch.
"""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["gradspec", "gradspec.*"]) + ["gradspec.kernels"],
    package_dir={"gradspec.kernels": "kernels"},
    ext_modules=[
        Pybind11Extension(
            "gradspec._C",
            ["csrc/spectral.cpp"],
            cxx_std=17,
            extra_compile_args=["-O3", "-fopenmp"],
            extra_link_args=["-fopenmp"],  # libgomp.so.1: torch's own copy when torch is imported first
        )
    ],
    cmdclass={"build_ext": build_ext},
)
