"""Which layers are scored, and how each kind of layer is found and split into parts: one file
per kind (linear.py, conv1d.py) registered in registry.py, fused projections in fused.py, the
selection in targets.py.
"""

from gradspec.layers import conv1d, linear  # noqa: F401  (registers the kinds)
