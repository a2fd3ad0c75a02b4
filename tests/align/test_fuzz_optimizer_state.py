"""`gradspec align --precondition adam --optimizer-state FILE` (issue 49, D7): the whole optimizer.pt is
checked where it is read, and whatever is wrong in it is one OptionInputError naming the file and the
field (a raw pickle, a list, a tensor, no state, a moment that is no tensor, of another shape, NaN or
negative, betas, eps or a step out of range), never a traceback. Then a seeded fuzz of such files
(random bytes, cut-short and garbled files, wrong types in each field, NaN and inf, wrong shapes): only
that one-line error comes out, or a state whose every value is in range."""

import copy
import io
import json
import math
import pickle
import random

import pytest
import torch
from conftest import tiny_model
from fuzzing import GONE, ODD, at, garbled, places, replaced

from gradspec.alignment.adam import read_adam_state
from gradspec.cli import main
from gradspec.errors import OptionInputError

VOCAB = 64
CASES = 300


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model and torch AdamW's state_dict for it after two steps, as transformers' Trainer makes
    and saves it (Trainer's parameter groups and numbering)."""
    return _trainer_adam_state(tiny_model("llama", vocab=VOCAB), tmp_path_factory.mktemp("adam"))


def _trainer_adam_state(model, folder, vocab: int = VOCAB) -> tuple:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(folder), report_to=[], use_cpu=True, learning_rate=1e-3,
                             weight_decay=0.01)
    optimizer = Trainer(model=model, args=args).create_optimizer()
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        ids = torch.randint(3, vocab, (2, 8), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, copy.deepcopy(optimizer.state_dict())


def _saved(path, state) -> object:
    torch.save(state, path)
    return path


def _error(path, model) -> str:
    with pytest.raises(OptionInputError) as caught:
        read_adam_state(path, model)
    message = str(caught.value)
    assert message.startswith(f"optimizer_state {path}: ") and "\n" not in message, message
    return message.removeprefix(f"optimizer_state {path}: ")


def _changed(state: dict, change) -> dict:
    state = copy.deepcopy(state)
    change(state)
    return state


def test_a_trainer_layout_state_is_read_whole(trained, tmp_path):
    model, state = trained
    read = read_adam_state(_saved(tmp_path / "optimizer.pt", state), model)
    assert read.step == 2 and read.betas == (0.9, 0.999) and read.eps == 1e-8 and read.lr == 1e-3
    assert set(read.moments) == {n for n, _ in model.named_parameters()}
    assert read_adam_state(tmp_path, model).describe()["optimizer_state"] == str(tmp_path)  # its folder


SHAPE = "(64, 64)"  # layer 0's q_proj: parameter 1 in Trainer's numbering (the embedding is 0)
LISTED = {  # (what the file holds, what the error says after its path)
    "a raw pickle": (None, "not loadable safely (Unsupported operand"),
    "an empty file": (b"", "not loadable safely (empty or cut short)"),
    "a list": ([1, 2], "a dict of state and param_groups expected (an optimizer's state_dict, as transformers' "
                       "Trainer saves it), got list [1, 2]"),
    "a tensor": (torch.zeros(3), "got a float32 tensor of shape (3,)"),
    "no state": (lambda s: s.pop("state"), "state: a non-empty dict expected (an optimizer that has stepped), got "
                                           "nothing"),
    "exp_avg=5": (lambda s: s["state"][1].update(exp_avg=5),
                  f"state[1].exp_avg: a float tensor of shape {SHAPE} expected (model.layers.0.self_attn.q_proj."
                  "weight's), got int 5"),
    "exp_avg_sq of another shape": (lambda s: s["state"][1].update(exp_avg_sq=torch.ones(64, 32)),
                                    f"state[1].exp_avg_sq: a float tensor of shape {SHAPE} expected (model.layers.0."
                                    "self_attn.q_proj.weight's), got a float32 tensor of shape (64, 32): not this "
                                    "model's optimizer"),
    "an int exp_avg_sq": (lambda s: s["state"][1].update(exp_avg_sq=torch.ones(64, 64, dtype=torch.int64)),
                          "state[1].exp_avg_sq: a float tensor of shape (64, 64) expected"),
    "a negative exp_avg_sq": (lambda s: s["state"][1]["exp_avg_sq"].__setitem__((1, 2), -1.0),
                              "state[1].exp_avg_sq: 1 of 4096 values negative: a second moment is >= 0"),
    "a NaN exp_avg_sq": (lambda s: s["state"][1]["exp_avg_sq"].__setitem__((1, 2), math.nan),
                         "state[1].exp_avg_sq: 1 of 4096 values NaN or infinite: a finite moment expected"),
    "an inf exp_avg": (lambda s: s["state"][3]["exp_avg"].__setitem__(0, math.inf),
                       "state[3].exp_avg: 64 of 2048 values NaN or infinite"),
    'betas="xy"': (lambda s: s["param_groups"][0].update(betas="xy"),
                   "param_groups[0].betas: two floats in [0, 1) expected, got str 'xy'"),
    "betas of 1": (lambda s: s["param_groups"][1].update(betas=(0.9, 1.0)),
                   "param_groups[1].betas: two floats in [0, 1) expected, got tuple (0.9, 1.0)"),
    'eps="nope"': (lambda s: s["param_groups"][0].update(eps="nope"),
                   "param_groups[0].eps: a finite number above 0 expected, got str 'nope'"),
    "lr=nan": (lambda s: s["param_groups"][0].update(lr=math.nan),
               "param_groups[0].lr: a finite number >= 0 expected, got float nan"),
    "step=inf": (lambda s: s["state"][0].update(step=torch.tensor(math.inf)),
                 "state[0].step: a finite count >= 1 expected, got inf (a float32 tensor of shape ())"),
    "no step": (lambda s: [entry.pop("step") for entry in s["state"].values()],
                "state[0].step: a finite count >= 1 expected, got nothing"),
    "a state of no parameter": (lambda s: s["state"].update({99: s["state"][0]}),
                                "state[99]: no parameter of that number in param_groups: not this model's optimizer"),
    "SGD's state": (lambda s: s["state"].update({0: {"momentum_buffer": torch.zeros(64, 64)}}),
                    "state[0]: a dict of exp_avg, exp_avg_sq and step expected (an Adam optimizer's state), got keys "
                    "['momentum_buffer']"),
    "groups of other constants": (lambda s: s["param_groups"][1].update(eps=1e-6),
                                  "param_groups[1]: betas, eps and lr ((0.9, 0.999), 1e-06, 0.001), "
                                  "param_groups[0]'s ((0.9, 0.999), 1e-08, 0.001)"),
    "AMSGrad's": (lambda s: s["param_groups"][0].update(amsgrad=True),
                  "param_groups[0].amsgrad: False expected (transformers' Trainer's AdamW), got bool True"),
}


@pytest.mark.parametrize("case", LISTED)
def test_each_wrong_optimizer_state_is_one_error_naming_its_field(case, trained, tmp_path):
    model, state = trained
    held, said = LISTED[case]
    path = tmp_path / "optimizer.pt"
    if held is None:
        path.write_bytes(pickle.dumps(state))
    elif isinstance(held, bytes):
        path.write_bytes(held)
    else:
        _saved(path, _changed(state, held) if callable(held) else held)
    assert said in _error(path, model)


def test_a_folder_without_an_optimizer_pt_is_named(trained, tmp_path):
    with pytest.raises(OptionInputError, match=f"optimizer_state {tmp_path}: no optimizer.pt"):
        read_adam_state(tmp_path, trained[0])


def test_align_says_what_is_wrong_with_the_optimizer_state_in_one_line(tmp_path, tiny_model_dir, capsys):
    from gradspec.data.models import load_model

    model, _ = load_model(str(tiny_model_dir))
    _, state = _trainer_adam_state(model, tmp_path / "trainer", vocab=1000)
    pool, task = tmp_path / "pool.jsonl", tmp_path / "task.jsonl"
    pool.write_text(json.dumps({"instruction": "What is 2+2?", "output": "4"}) + "\n")
    task.write_text(json.dumps({"instruction": "What is 7+1?", "output": "8"}) + "\n")
    for name, held, said in [
        ("pickle.pt", None, "not loadable safely (Unsupported operand 149)"),
        ("five.pt", _changed(state, lambda s: s["state"][3].update(exp_avg=5)), "state[3].exp_avg: a float tensor"),
    ]:
        path = tmp_path / name
        path.write_bytes(pickle.dumps(state)) if held is None else _saved(path, held)
        assert main(["align", "--data", str(pool), "--target", str(task), "--model", str(tiny_model_dir),
                     "--out", str(tmp_path / "a.parquet"), "--max-length", "32", "--quiet", "--precondition", "adam",
                     "--optimizer-state", str(path)]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert err.strip().splitlines()[-1].startswith(f"gradspec: error: --optimizer-state {path}: {said}"), err
        assert sum(line.startswith("gradspec: error:") for line in err.splitlines()) == 1


# The torch values a field may be given beside fuzzing.ODD's
TENSORS = [b"\x00", torch.tensor(math.nan), torch.tensor(math.inf), torch.tensor(3), torch.tensor(True),
           torch.tensor([1.0, 2.0]), torch.zeros(3), torch.zeros(2, 2), torch.zeros(64, 64, dtype=torch.float16),
           torch.zeros(0), torch.tensor(1 + 2j), (1,), (0.5, 0.5, 0.5)]


def _spoiled_tensor(rng: random.Random, t: torch.Tensor) -> torch.Tensor:
    """t with a few values NaN, inf or negative, or of another shape or type."""
    t = t.clone()
    kind = rng.randrange(5)
    if kind < 3 and t.numel():
        flat = t.view(-1)
        for _ in range(rng.randrange(1, 4)):
            flat[rng.randrange(t.numel())] = [math.nan, math.inf, -1.0][kind]
        return t
    if kind == 3:
        return t.reshape(-1) if t.dim() != 1 else t[:-1]
    return t.to(torch.int32)


def _mutated(rng: random.Random, state: dict, valid: bytes) -> bytes:
    """A file's bytes: the valid file garbled (random, cut short, bytes changed), or the state with one
    thing changed, removed, or the whole of it another thing."""
    if rng.random() < 0.3:
        return garbled(rng, valid)
    path = rng.choice(list(places(state))[1:])
    here = at(state, path)
    if isinstance(here, torch.Tensor) and here.dim() and rng.random() < 0.7:
        new = _spoiled_tensor(rng, here)
    else:
        new = GONE if rng.random() < 0.15 else rng.choice(ODD + TENSORS)
    if rng.random() < 0.05:
        path, new = (), rng.choice(ODD + TENSORS)
    buffer = io.BytesIO()
    torch.save(replaced(state, path, new), buffer)
    return buffer.getvalue()


# What the cases must have met, so that the generator keeps reaching them
MET = ["not loadable safely", "a float tensor of shape", "values NaN or infinite", "values negative",
       "two floats in [0, 1) expected", "a finite count >= 1 expected", "a finite number above 0 expected",
       "not this model's optimizer", "a dict of state and param_groups expected"]


def test_random_optimizer_states_meet_only_one_line_errors(trained, tmp_path):
    model, state = trained
    buffer = io.BytesIO()
    torch.save(state, buffer)
    valid = buffer.getvalue()
    rng = random.Random("gradspec-fuzz-optimizer-state")
    errors, read = [], 0
    for case in range(CASES):
        path = tmp_path / f"{case}.pt"
        path.write_bytes(_mutated(rng, state, valid))
        try:
            adam = read_adam_state(path, model)
        except OptionInputError as e:
            message = str(e)
            assert message.startswith(f"optimizer_state {path}: ") and "\n" not in message, message
            errors.append(message)
            continue
        read += 1
        b1, b2 = adam.betas
        assert 0 <= b1 < 1 and 0 <= b2 < 1 and 0 < adam.eps < math.inf and 0 <= adam.lr < math.inf
        assert isinstance(adam.step, int) and adam.step >= 1
        for m, v in adam.moments.values():
            assert torch.isfinite(m).all() and torch.isfinite(v).all() and (v >= 0).all()
    assert read > 0 and len(errors) > CASES // 2
    assert all(any(kind in e for e in errors) for kind in MET), [k for k in MET if not any(k in e for e in errors)]
