"""validate --metric lm-eval:TASK[:METRIC]: lm-eval's task metric after each retrain. Its wiring (the task
checked before any retrain, the model evaluated in memory, the named metric picked, the random state put
back) against a stand-in lm_eval, always; against the real lm-eval on a task YAML of our own where
lm-eval is installed (it is not a dependency)."""

import json
import random
import sys
import types

import numpy as np
import pandas as pd
import pytest
import torch

from gradspec.cli import main
from gradspec.options import OptionError
from gradspec.validation.lm_eval_metric import lm_eval_metric, pick

ROWS = [{"instruction": f"Question {i}: what is {i} plus one?", "output": f"It is {i + 1}."} for i in range(6)]
RESULTS = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1, "perplexity,none": 9.0}},
           "higher_is_better": {"t": {"acc": True, "perplexity": False}}}


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "task.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    return tmp_path


def _validate(model, folder, out, metric, *extra):
    return main(["validate", "--model", str(model), "--data", str(folder / "train.jsonl"), "--target",
                 str(folder / "task.jsonl"), "--out", str(out), "--subsets", "3", "--batch-size", "2",
                 "--learning-rate", "1e-3", "--quiet", "--metric", metric, *extra])


def test_the_named_metric_is_picked_and_a_lower_is_better_one_refused():
    assert pick(RESULTS, "t", "acc", "s") == 0.5 and pick(RESULTS, "t", "acc,none", "s") == 0.5
    assert pick(RESULTS, "t", "", "s") == 0.5  # the first higher-is-better metric, never a stderr
    with pytest.raises(OptionError, match="lower-is-better"):
        pick(RESULTS, "t", "perplexity", "s")
    with pytest.raises(OptionError, match="reports no metric 'f1'; it reports acc,none, perplexity,none"):
        pick(RESULTS, "t", "f1", "s")


@pytest.fixture
def stand_in(monkeypatch):
    """An lm_eval module whose one task ('sum_task') reports the model's weight sum as acc, after scrambling
    Python's, NumPy's and torch's random state as the real simple_evaluate's seeding does."""
    calls = []

    class TaskManager:
        all_tasks = ["sum_task"]

        def __init__(self, include_path=None):
            calls.append("tasks set up")

    class HFLM:
        def __init__(self, pretrained, tokenizer, batch_size):
            self.model = pretrained

    def simple_evaluate(model, tasks, limit, **_):
        calls.append(limit)
        random.seed(1234), np.random.seed(1234), torch.manual_seed(1234)
        total = float(sum(p.detach().double().sum() for p in model.model.parameters()))
        return {"results": {tasks[0]: {"acc,none": total}}, "higher_is_better": {tasks[0]: {"acc": True}}}

    lm_eval = types.ModuleType("lm_eval")
    lm_eval.simple_evaluate = simple_evaluate
    modules = {"lm_eval": lm_eval, "lm_eval.tasks": types.ModuleType("lm_eval.tasks"),
               "lm_eval.models": types.ModuleType("lm_eval.models"),
               "lm_eval.models.huggingface": types.ModuleType("lm_eval.models.huggingface")}
    modules["lm_eval.tasks"].TaskManager = TaskManager
    modules["lm_eval.models.huggingface"].HFLM = HFLM
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def test_each_retrain_s_metric_is_the_task_s_and_the_random_state_is_put_back(stand_in, tiny_model_dir, inputs,
                                                                               tmp_path):
    """Also: lm-eval's tasks are set up once per run (checked and used by the same callable)."""
    random.seed(7), np.random.seed(7)
    expected = random.random(), np.random.random()
    random.seed(7), np.random.seed(7)
    assert _validate(tiny_model_dir, inputs, tmp_path / "v.parquet", "lm-eval:sum_task:acc", "--metric-limit",
                     "5") == 0
    assert (random.random(), np.random.random()) == expected
    table = pd.read_parquet(tmp_path / "v.parquet")
    assert stand_in == ["tasks set up", 5, 5, 5] and table["metric"].notna().all() and table["metric"].nunique() >= 2
    # the metric is the weight sum of each retrained model: the same retrains with module:function agree
    (tmp_path / "weights.py").write_text("def weight_sum(model, tokenizer):\n"
                                         "    return float(sum(p.double().sum() for p in model.parameters()))\n")
    sys.path.insert(0, str(tmp_path))
    try:
        assert _validate(tiny_model_dir, inputs, tmp_path / "w.parquet", "weights:weight_sum") == 0
    finally:
        sys.path.remove(str(tmp_path))
    assert pd.read_parquet(tmp_path / "w.parquet")["metric"].tolist() == table["metric"].tolist()


def test_a_bad_lm_eval_metric_is_named_before_any_retrain(stand_in, tiny_model_dir, inputs, tmp_path, monkeypatch,
                                                          capsys):
    assert _validate(tiny_model_dir, inputs, tmp_path / "v.parquet", "lm-eval:no_such_task") == 2
    assert "lm-eval knows no task 'no_such_task'" in capsys.readouterr().err
    assert _validate(tiny_model_dir, inputs, tmp_path / "v.parquet", "lm-eval:missing.yaml") == 2
    assert "lm-eval:missing.yaml: no such task file" in capsys.readouterr().err
    assert _validate(tiny_model_dir, inputs, tmp_path / "v.parquet", "my_eval:accuracy", "--metric-limit", "3") == 2
    assert "--metric-limit applies to an lm-eval metric" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "lm_eval.tasks", None)  # lm-eval not installed
    assert _validate(tiny_model_dir, inputs, tmp_path / "v.parquet", "lm-eval:sum_task") == 2
    assert "needs lm-eval (pip install lm-eval)" in capsys.readouterr().err
    assert not (tmp_path / "v.parquet").exists()


TASK_YAML = """task: gradspec_plus_one
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def test_a_real_lm_eval_task_yaml_scores_the_model_in_memory(tiny_model_dir, tmp_path):
    """The real lm-eval (where installed) on a multiple-choice task of our own: accuracy in [0, 1], the model's
    weights, mode and random state as they were."""
    pytest.importorskip("lm_eval")
    from gradspec.data.models import load_model

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"question": f"What is {i} plus one?", "choices": [str(i + 1), str(i + 7)],
                                        "answer": 0}) + "\n" for i in range(4)))
    (tmp_path / "task.yaml").write_text(TASK_YAML.format(docs=docs))
    model, tokenizer = load_model(str(tiny_model_dir), progress=False)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.random.get_rng_state()
    value = lm_eval_metric(f"lm-eval:{tmp_path / 'task.yaml'}:acc", limit=3)(model, tokenizer)
    assert 0.0 <= value <= 1.0 and value * 3 == round(value * 3)  # 3 documents
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.random.get_rng_state(), state)
