"""What it costs a training run: the monitor per step, its writes, and validate's retrains against a bare loop."""
