"""On a GPU: the acceptance run (every path against the CPU fp64 reference, then the suite), the
Triton launches compiled for every architecture, the cost model, and the precisions."""
