"""The engine: capture hooks on one forward and backward, per-sample spectra of each layer's
gradient, and the slow reference it is tested against.
"""
