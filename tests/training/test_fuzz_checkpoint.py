"""`gradspec train --resume` (issue 49, D10): the checkpoint it continues from is vetted before
transformers' Trainer reads it, and a pickle in rng_state.pth, scheduler.pt or optimizer.pt (refused by
torch's weights_only) is one line naming the file, exit 2, not a traceback and exit 1. What Trainer
still raises while it loads them is named the same way; training_args.bin, a pickle by design, is never
unpickled. Then a seeded fuzz of a checkpoint's files (random bytes, cut-short and garbled files, wrong
types in each field, NaN and inf, wrong shapes): the vetting lets out only that one-line error, and
what it passes Trainer loads and trains a step on, every weight finite after it."""

import io
import json
import math
import os
import pickle
import random
import shutil
import warnings

import pytest
import torch
from conftest import one_thread, tiny_model
from fuzzing import GONE, ODD, at, garbled, places, replaced

from gradspec.cli import main
from gradspec.errors import OptionInputError

VOCAB = 64
INDICES = [0, 1, 2, 3]
CASES = 160
DYNAMICS = {"epoch 1": {str(i): {"mean_token_prob": 0.1, "perplexity": 9.0, "token_accuracy": 0.0, "status": "ok"}
                        for i in INDICES}}


def _rows() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (ids := torch.randint(3, VOCAB, (8,), generator=g)), "labels": ids} for _ in INDICES]


def _trainer(out, max_steps: int = 2):
    """transformers' Trainer of a tiny model as gradspec train makes it (AdamW, a scheduler, saving each step)."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, max_steps=max_steps,
                             save_strategy="steps", save_steps=1, report_to=[], use_cpu=True, learning_rate=1e-3,
                             weight_decay=0.01, disable_tqdm=True, logging_strategy="no")
    return Trainer(model=tiny_model("llama", vocab=VOCAB), args=args, train_dataset=_rows())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A Trainer checkpoint after one step (with the dynamics gradspec keeps there), and its files' bytes."""
    out = tmp_path_factory.mktemp("resume") / "run"
    _trainer(out, max_steps=1).train()
    checkpoint = out / "checkpoint-1"
    (checkpoint / "gradspec_dynamics.json").write_text(json.dumps(DYNAMICS))
    return checkpoint, {p.name: p.read_bytes() for p in checkpoint.iterdir()}


def _vetting_error(checkpoint) -> str | None:
    """The vetting's one-line error (after 'resume: '), or None where it passes the checkpoint."""
    from gradspec.training.checkpoint import vet_checkpoint

    try:
        vet_checkpoint(checkpoint, _trainer(checkpoint.parent), INDICES)
    except OptionInputError as e:
        message = str(e)
        assert message.startswith(f"resume: {checkpoint}") and "\n" not in message, message
        return message.removeprefix("resume: ")
    return None


@pytest.mark.parametrize("kind", [{"lr_scheduler_type": "reduce_lr_on_plateau", "eval_strategy": "steps",
                                   "eval_steps": 100}, {"optim": "sgd"},
                                  {"optim": "adagrad", "weight_decay": 0.0}, {"optim": "adafactor"}])
def test_checkpoints_of_other_schedulers_and_optimizers_pass(kind, tmp_path):
    """What Trainer itself resumes from is not refused: ReduceLROnPlateau's state holds inf before its first
    evaluation (mode_worse, best), and SGD's weight_decay made as 0 is any number, not a whole one."""
    from transformers import Trainer, TrainingArguments

    from gradspec.training.checkpoint import vet_checkpoint

    def trainer():
        args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=1,
                                 save_strategy="steps", save_steps=1, report_to=[], use_cpu=True, learning_rate=1e-3,
                                 disable_tqdm=True, logging_strategy="no", **{"weight_decay": 0.01, **kind})
        return Trainer(model=tiny_model("llama", vocab=VOCAB), args=args, train_dataset=_rows(), eval_dataset=_rows())

    trainer().train()
    vet_checkpoint(tmp_path / "run" / "checkpoint-1", trainer(), INDICES)


def test_a_trainer_checkpoint_passes_and_trainer_s_loaders_are_there(saved):
    from transformers import Trainer

    from gradspec.training.checkpoint import LOADERS

    checkpoint, _ = saved
    assert _vetting_error(checkpoint) is None
    assert all(callable(getattr(Trainer, name, None)) for name in LOADERS)  # a renamed one would go unguarded


class _Runs:
    """Unpickling it would write a file: whether a pickle was ever loaded unsafely."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


PICKLED = {"rng_state.pth": "rng_state.pth: not loadable safely (Unsupported operand 149)",
           "scheduler.pt": "scheduler.pt: not loadable safely (Unsupported operand 149)",
           "optimizer.pt": "optimizer.pt: not loadable safely (Unsupported operand 149)",
           "scaler.pt": "scaler.pt: not loadable safely (Unsupported operand 149)"}
LISTED = {  # (file, what it holds instead, what the error says after the checkpoint's path)
    "a raw pickle of each torch file": None,
    "a torch.save'd pickle that would run code": ("optimizer.pt", "torch-runs", "optimizer.pt: not loadable "
                                                 "safely (Unsupported global: GLOBAL io.open was not an allowed"),
    "an empty optimizer.pt": ("optimizer.pt", b"", "optimizer.pt: not loadable safely (empty or cut short)"),
    "a cut-short scheduler.pt": ("scheduler.pt", "cut", "scheduler.pt: not loadable safely (PytorchStreamReader"),
    "a python RNG state that is not one": ("rng_state.pth", {"python": (3, "x", None)},
                                           "rng_state.pth: python: not a python RNG state"),
    "no numpy or cpu RNG state": ("rng_state.pth", {"python": random.getstate()},
                         "rng_state.pth: numpy: missing; Trainer's RNG states (python, numpy, cpu) expected"),
    "a scheduler whose step is replaced": ("scheduler.pt", {"step": 1},
                                           "scheduler.pt: the state: 'step': none of the keys of the state Trainer "
                                           "makes"),
    "a scheduler of text learning rates": ("scheduler.pt", {"base_lrs": ["x", "y"]},
                                           "scheduler.pt: base_lrs[0]: a finite number >= 0 expected, got str 'x'"),
    "an optimizer of another eps": ("optimizer.pt", {"eps": "nope"},
                                    "optimizer.pt: param_groups[0].eps: a finite number >= 0 expected, got str"),
    "a NaN second moment": ("optimizer.pt", {"nan": True},
                            "optimizer.pt: state[1].exp_avg_sq: 1 of 4096 values NaN or infinite"),
    "trainer_state.json not JSON": ("trainer_state.json", b"{", "trainer_state.json:1: malformed JSON"),
    "a text global_step": ("trainer_state.json", {"global_step": "7"},
                           "trainer_state.json: global_step: int expected, got str '7'"),
    "an unknown trainer state field": ("trainer_state.json", {"steps": 1},
                                       "trainer_state.json: steps: none of TrainerState's fields"),
    "weights that are not safetensors": ("model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}",
                                         "model.safetensors: not a readable safetensors file"),
    "weights of another shape": ("model.safetensors", {"model.norm.weight": torch.ones(3)},
                                 "model.safetensors: model.norm.weight: shape (3,), the model's (64,): not this "
                                 "model's weights"),
    "NaN weights": ("model.safetensors", {"model.norm.weight": torch.full((64,), math.nan)},
                    "model.safetensors: model.norm.weight: 64 of 64 values NaN or infinite"),
    "the dynamics of other rows": ("gradspec_dynamics.json", {"epoch 1": {"0": DYNAMICS["epoch 1"]["0"]}},
                                   "gradspec_dynamics.json: 'epoch 1': measures of 1 samples, not of this run's 4"),
}


def _written(checkpoint, name: str, held, original: bytes, tmp_path) -> None:
    """checkpoint's file name made to hold held: bytes as they are, a change of its state (a dict of what
    to change), a raw pickle, code to run."""
    path = checkpoint / name
    if isinstance(held, bytes):
        path.write_bytes(held)
    elif held == "cut":
        path.write_bytes(original[: len(original) // 2])
    elif held == "torch-runs":
        torch.save({"state": _Runs(tmp_path / "ran")}, path)
    elif name.endswith(".json"):
        path.write_text(json.dumps(held if name == "gradspec_dynamics.json" else {**json.loads(original), **held}))
    elif name.endswith(".safetensors"):
        from safetensors.torch import load, save_file

        save_file({**load(original), **held}, str(path))
    elif name == "optimizer.pt":
        state = torch.load(io.BytesIO(original), weights_only=True)
        if "eps" in held:
            state["param_groups"][0]["eps"] = held["eps"]
        else:
            state["state"][1]["exp_avg_sq"][1, 2] = math.nan
        torch.save(state, path)
    elif name == "scheduler.pt":
        torch.save({**torch.load(io.BytesIO(original), weights_only=True), **held}, path)
    else:
        torch.save(held, path)


@pytest.mark.parametrize("case", LISTED)
def test_each_damaged_or_crafted_file_is_one_error_naming_it(case, saved, tmp_path):
    checkpoint, files = saved
    copy = tmp_path / "run" / "checkpoint-1"
    shutil.copytree(checkpoint, copy)
    if LISTED[case] is None:
        for name, said in PICKLED.items():
            (copy / name).write_bytes(pickle.dumps({"a": [1, 2]}))
            assert _vetting_error(copy) == f"{copy}/{said}"
            (copy / name).unlink() if name not in files else (copy / name).write_bytes(files[name])
        return
    name, held, said = LISTED[case]
    _written(copy, name, held, files[name], tmp_path)
    error = _vetting_error(copy)
    assert error is not None and error.startswith(f"{copy}/{said}"), error
    assert not (tmp_path / "ran").exists()


def test_what_trainer_raises_loading_a_file_is_one_error_naming_it(saved, tmp_path):
    """Past the vetting (a file changed after it), what Trainer's loader raises is named the same way."""
    from gradspec.training.checkpoint import named_load_errors

    checkpoint, _ = saved
    copy = tmp_path / "run" / "checkpoint-1"
    shutil.copytree(checkpoint, copy)
    (copy / "rng_state.pth").write_bytes(pickle.dumps({"a": 1}))
    trainer = _trainer(copy.parent)
    with pytest.raises(OptionInputError) as caught, named_load_errors(trainer, copy), warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's warning about the pickle's protocol: not given for a refused file
        trainer.train(resume_from_checkpoint=str(copy))
    assert str(caught.value) == f"resume: {copy}: rng_state.pth: not loadable (Unsupported operand 149)"
    assert "_load_rng_state" not in vars(trainer)  # the trainer's own loaders back


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, tiny_model_dir):
    """A gradspec train run of one step, its checkpoint kept, as a stopped run leaves it; and the data."""
    folder = tmp_path_factory.mktemp("stopped")
    data = folder / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Q {i}?", "output": f"A {i}."}) + "\n" for i in range(4)))
    out = folder / "run"
    assert main(_train(tiny_model_dir, data, out, "--max-steps", "1")) == 0
    shutil.rmtree(out / "model")
    return out, data


def _train(model, data, out, *more: str) -> list[str]:
    return ["train", "--model", str(model), "--data", str(data), "--out", str(out), "--batch-size", "2",
            "--trainer-args", "save_steps=1", *more]


RESUME = ("--max-steps", "2", "--resume", "last")


@pytest.mark.parametrize("name", ["rng_state.pth", "scheduler.pt", "optimizer.pt"])
def test_train_resume_from_a_pickle_says_so_in_one_line(name, stopped_run, tiny_model_dir, tmp_path, capsys):
    run, data = stopped_run
    out = tmp_path / "run"
    shutil.copytree(run, out)
    (out / "checkpoint-1" / name).write_bytes(pickle.dumps({"a": [1, 2]}))
    capsys.readouterr()
    assert main(_train(tiny_model_dir, data, out, *RESUME)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and sum(line.startswith("gradspec: error:") for line in err.splitlines()) == 1
    assert err.strip().splitlines()[-1] == (f"gradspec: error: --resume: {out}/checkpoint-1/{name}: not loadable "
                                            "safely (Unsupported operand 149)")
    assert not (out / "model").exists()


def test_train_resume_never_unpickles_training_args(stopped_run, tiny_model_dir, tmp_path, capsys):
    """Trainer writes training_args.bin (a pickle of its TrainingArguments) and reads it not on resume."""
    run, data = stopped_run
    out = tmp_path / "run"
    shutil.copytree(run, out)
    (out / "checkpoint-1" / "training_args.bin").write_bytes(pickle.dumps(_Runs(tmp_path / "ran")))
    assert main(_train(tiny_model_dir, data, out, *RESUME)) == 0
    assert (out / "model").is_dir() and not (tmp_path / "ran").exists()


def _resumed(checkpoint) -> None:
    """What Trainer does with a checkpoint's files on resume (its loaders, named as a run names them),
    then a training step: every weight finite after it."""
    from transformers import TrainerState

    from gradspec.training.checkpoint import named_load_errors

    trainer = _trainer(checkpoint.parent)
    trainer.create_optimizer_and_scheduler(num_training_steps=2)
    try:
        with named_load_errors(trainer, checkpoint):
            trainer._load_from_checkpoint(str(checkpoint))
            trainer.state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
            trainer._load_rng_state(str(checkpoint))
            trainer._load_optimizer_and_scheduler(str(checkpoint))
    except OptionInputError as e:
        assert str(e).startswith(f"resume: {checkpoint}: ") and "\n" not in str(e), str(e)
        return
    ids = torch.randint(3, VOCAB, (2, 8))
    trainer.model(input_ids=ids, labels=ids).loss.backward()
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert all(math.isfinite(lr) and lr >= 0 for lr in trainer.lr_scheduler.get_last_lr())


def _loaded(name: str, data: bytes):
    """A file's state, as the fuzz changes it (the checkpoint's own files: trusted)."""
    if name.endswith(".json"):
        return json.loads(data)
    if name.endswith(".safetensors"):
        from safetensors.torch import load

        return load(data)
    return torch.load(io.BytesIO(data), weights_only=False)


def _dumped(name: str, state) -> bytes:
    if name.endswith(".json"):
        return json.dumps(state).encode()
    if name.endswith(".safetensors"):
        from safetensors.torch import save

        return save(state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


TENSORS = [torch.tensor(math.nan), torch.tensor(3), torch.zeros(3), torch.zeros(2, 2),
           torch.zeros(5, dtype=torch.uint8)]


def _mutated(rng: random.Random, name: str, data: bytes) -> bytes:
    """A file's bytes garbled, or its state with one thing changed or removed (a tensor spoiled: NaN, inf,
    negative, another shape)."""
    if rng.random() < 0.3 or name == "training_args.bin":
        return garbled(rng, data)
    state = _loaded(name, data)
    spots = list(places(state))[1:]
    shallow = [p for p in spots if len(p) <= 2]
    path = rng.choice(shallow if shallow and rng.random() < 0.5 else spots)
    here = at(state, path)
    if isinstance(here, torch.Tensor) and here.dim() and here.is_floating_point() and rng.random() < 0.7:
        new = here.clone()
        new.view(-1)[rng.randrange(new.numel())] = rng.choice([math.nan, math.inf, -1.0])
        new = new if rng.random() < 0.7 else new.reshape(-1)[:-1]
    elif name.endswith(".safetensors"):
        new = rng.choice(TENSORS)
    else:
        new = GONE if rng.random() < 0.15 else rng.choice(ODD + ([] if name.endswith(".json") else TENSORS))
    try:
        return _dumped(name, replaced(state, path, new))
    except (TypeError, ValueError):  # what the format cannot hold (JSON a tensor, safetensors a non-tensor)
        return garbled(rng, data)


FILES = ["trainer_state.json", "rng_state.pth", "optimizer.pt", "scheduler.pt", "model.safetensors", "config.json",
         "gradspec_dynamics.json", "training_args.bin"]
# What the cases must have met, so that the generator keeps reaching them
MET = ["not loadable safely", "malformed JSON", "expected, got", "rng_state.pth: python",
       "not a readable safetensors file", "values NaN or infinite", "gradspec_dynamics.json", "scheduler.pt: "]


def test_random_checkpoint_files_meet_only_one_line_errors(saved, tmp_path):
    checkpoint, files = saved
    copy = tmp_path / "run" / "checkpoint-1"
    shutil.copytree(checkpoint, copy)
    rng = random.Random("gradspec-fuzz-checkpoint")
    errors, passed = [], 0
    with one_thread():  # a tiny model's step: torch's thread pool would only wait on a busy machine
        for _ in range(CASES):
            name = rng.choice(FILES)
            (copy / name).write_bytes(_mutated(rng, name, files[name]))
            error = _vetting_error(copy)
            if error is None:
                passed += 1
                _resumed(copy)
            else:
                errors.append(error)
            (copy / name).write_bytes(files[name])
    assert passed > 5 and len(errors) > CASES // 2
    assert all(any(kind in e for e in errors) for kind in MET), [k for k in MET if not any(k in e for e in errors)]
    assert os.listdir(copy) == os.listdir(checkpoint)
