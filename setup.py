"""Builds gradspec._C from csrc/ with pybind11; kernels/ ships as gradspec.kernels
(gradspec/kernels is a link to it, so the package imports the same from a checkout).

LAPACK and BLAS are bound at import time from SciPy's function pointers, so the
build needs neither their headers nor torch.
"""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

setup(
    packages=["gradspec", "gradspec.kernels"],
    ext_modules=[
        Pybind11Extension(
            "gradspec._C",
            ["csrc/spectral.cpp"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        )
    ],
    cmdclass={"build_ext": build_ext},
)
