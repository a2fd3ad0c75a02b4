"""Runs over whole datasets: chunked, resumable, sharded scoring into a run folder, torchrun, the
classic data-quality scores computed in the same run, and the score files.
"""
