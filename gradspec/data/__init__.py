"""What a run reads: samples from files (readers), chat templates and label spans (templates), the
model (models), and the batches they make (batching).
"""
