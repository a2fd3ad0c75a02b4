"""The linear algebra: precision policy, Grams, eigen stages and their paths (C++ extension, torch,
CuPy, Triton), the low-rank sketch, and the metrics of a spectrum.
"""
