"""How much memory: peak RSS of scoring, of the planned batches, under checkpointing, and of streaming input."""
