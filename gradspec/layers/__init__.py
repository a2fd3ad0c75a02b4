"""Which layers are scored, and how each kind of layer (Linear, Conv1D, fused projections) is found
and split into parts.
"""
