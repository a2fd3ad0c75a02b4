"""A task metric from lm-eval (EleutherAI's lm-evaluation-harness), for validate's --metric
lm-eval:TASK[:METRIC]: after each retrain, lm-eval evaluates the model in memory (its HFLM wrapper, no
reload) on a registered task or a task YAML of the user's, and the named metric becomes the retrain's
metric. lm-eval is optional: it is imported only when such a metric is asked for.

lm-eval seeds Python's, NumPy's and torch's global generators; their states are put back afterwards, so
that the retrains (and the caller's program) see the random state they had."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gradspec.files import read_text
from gradspec.options import OptionError

PREFIX = "lm-eval:"
EVAL_BATCH = 8


def is_lm_eval(spec: str) -> bool:
    return spec.startswith(PREFIX)


def lm_eval_metric(spec: str, limit: int | None = None) -> Callable[[Any, Any], float]:
    """The callable metric(model, tokenizer) of spec 'lm-eval:TASK[:METRIC]': TASK is a task name lm-eval
    knows or the path of a task YAML (its folder is added to lm-eval's task paths); METRIC, one of its
    metrics (default: the first it reports), must be one lm-eval marks higher-is-better. limit: the task's
    first documents only. Checked here, before any retrain: lm-eval installed, the task known."""
    task, _, metric = spec[len(PREFIX):].partition(":")
    if not task:
        raise OptionError("metric", f"{spec!r}: expected lm-eval:TASK or lm-eval:TASK:METRIC, e.g. "
                          "lm-eval:arc_easy:acc")
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise OptionError("metric", f"{spec}: needs lm-eval (pip install lm-eval), or give module:function") from None
    manager, name = _task(task, TaskManager)
    if name not in manager.all_tasks:
        raise OptionError("metric", f"{spec}: lm-eval knows no task {name!r} (lm-eval --tasks list shows them)")

    def evaluate(model, tokenizer) -> float:
        import torch  # here: validate --runs never loads it
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM

        python, numpy, devices = random.getstate(), np.random.get_state(), _devices(model)
        with torch.random.fork_rng(devices=devices):
            try:
                results = simple_evaluate(model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=EVAL_BATCH),
                                          tasks=[name], limit=limit, task_manager=manager, log_samples=False,
                                          bootstrap_iters=0)
            finally:
                random.setstate(python)
                np.random.set_state(numpy)
        return pick(results, name, metric, spec)

    return evaluate


def pick(results: dict[str, Any], task: str, metric: str, spec: str) -> float:
    """The metric's value in simple_evaluate's results (keys 'METRIC,FILTER'); the first higher-is-better
    metric where none is named."""
    values = {k: v for k, v in results["results"][task].items() if "," in k and "_stderr" not in k}
    better = results.get("higher_is_better", {}).get(task, {})
    if metric:
        found = [k for k in values if k == metric or k.split(",")[0] == metric]
        if not found:
            raise OptionError("metric", f"{spec}: task {task} reports no metric {metric!r}; it reports "
                              f"{', '.join(values) or 'none'}")
    else:
        found = [k for k in values if better.get(k.split(",")[0], True)]
    key = found[0] if found else next(iter(values), None)
    if key is None:
        raise OptionError("metric", f"{spec}: task {task} reported no metric")
    if better.get(key.split(",")[0]) is False:
        raise OptionError("metric", f"{spec}: lm-eval marks {key} lower-is-better; validate's metric is higher-is-"
                          "better: name another metric of the task")
    return float(values[key])


def _task(task: str, manager_class) -> tuple[Any, str]:
    """The task manager and the task's name: a YAML file's own 'task' name, its folder added to the paths."""
    path = Path(task)
    if path.suffix not in (".yaml", ".yml"):
        return manager_class(), task
    if not path.is_file():
        raise OptionError("metric", f"lm-eval:{task}: no such task file")
    import yaml

    try:
        name = (yaml.safe_load(read_text(path)) or {}).get("task")
    except yaml.YAMLError as e:
        raise OptionError("metric", f"lm-eval:{task}: not YAML ({e})") from None
    if not isinstance(name, str):
        raise OptionError("metric", f"lm-eval:{task}: the file names no task (its 'task:' field)")
    return manager_class(include_path=str(path.resolve().parent)), name


def _devices(model) -> list:
    device = next(model.parameters()).device
    return [device] if device.type == "cuda" else []
