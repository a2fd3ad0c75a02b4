"""Training recipes and tools: WIT, SFTMix, training dynamics, the live spectral monitor, and
`gradspec train`.
"""
