"""gradspec's benchmarks, grouped by the question each answers (each group's __init__ says which); run a file with
``pytest benchmarks/<group>/<file>.py -s`` or a script with ``python -m benchmarks.<group>.<name>`` from the
repository root. What they share (shapes, HumanEval batches, floors, peak RSS, rounds) is in common."""
