"""Runs over whole datasets: chunked, resumable, sharded scoring into a run folder, torchrun, and
the score files.
"""
