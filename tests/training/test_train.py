import errno
import json
import os
import signal
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors import SafetensorError

from gradspec.cli import main
from gradspec.data.readers import Fields, read_samples
from gradspec.data.templates import tokenize
from gradspec.training.dynamics import read_dynamics
from gradspec.training.monitor_parts import read_monitor

ROWS = [{"instruction": f"Question {i}: what is {i} plus one?", "output": f"It is {i + 1}" + ", of course" * i}
        for i in range(8)]  # each its own length: a monitor row is mapped back to its row by it


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("train") / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


@pytest.mark.parametrize("loss", ["ntp", "wit", "sftmix"])
def test_gradspec_train_end_to_end(loss, data, tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / loss
    args = ["train", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(out), "--loss", loss,
            "--epochs", "2", "--batch-size", "4", "--learning-rate", "1e-2", "--monitor-every", "2"]
    assert main(args) == 0
    assert "wrote" in capsys.readouterr().out
    trained = AutoModelForCausalLM.from_pretrained(out / "model")
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(trained.state_dict()[q], start.state_dict()[q])
    dynamics, meta = read_dynamics(out / "dynamics.parquet")
    assert meta["checkpoints"] == ["epoch 1", "epoch 2"] and dynamics["index"].tolist() == list(range(8))
    monitor = pd.read_parquet(out / "monitor.parquet")
    assert monitor["step"].unique().tolist() == [2, 4]  # steps 2 and 4 of 4, where Trainer logs
    assert monitor["scaled"].all() == (loss != "sftmix")
    assert monitor.filter(like="/effective_rank").notna().all().all()
    # each monitor row names its sample: the row of that index has its length
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    lengths = [len(tokenize(s.messages, tokenizer, "plain", 512).input_ids) for s in read_samples(data, Fields())]
    assert len(set(lengths)) == 8 and monitor["sample_index"].notna().all()
    assert monitor["num_tokens"].tolist() == [lengths[i] for i in monitor["sample_index"]]


def test_gradspec_dynamics_from_checkpoints(data, tiny_model_dir, tmp_path):
    out = tmp_path / "train"
    main(["train", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(out), "--epochs", "3",
          "--learning-rate", "1e-2"])
    table = tmp_path / "dyn.parquet"
    assert main(["dynamics", "--checkpoints", str(tiny_model_dir), str(out / "model"), "--data", str(data),
                 "--out", str(table)]) == 0
    dynamics, meta = read_dynamics(table)
    assert meta["checkpoints"] == [str(tiny_model_dir), str(out / "model")]
    assert all(p[1] < p[0] for p in dynamics["perplexity"])  # the fine-tuned checkpoint fits better


def test_train_stops_when_most_samples_have_no_response_tokens(data, one_token_model_dir, tmp_path, capsys):
    args = ["train", "--model", str(one_token_model_dir), "--data", str(data), "--out", str(tmp_path / "run")]
    assert main(args) == 2
    assert "8 of 8 rows have no response tokens (no_response_tokens 8): check the tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "run" / "model").exists()


def test_monitor_modules_that_match_nothing_stop_before_training(data, tiny_model_dir, tmp_path, capsys):
    """Named before the first step, not when the monitor first runs (after --monitor-every steps)."""
    args = ["train", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(tmp_path / "run"),
            "--modules", "zzz", "--max-steps", "1"]
    assert main(args) == 2
    assert "no module matches --modules 'zzz'" in capsys.readouterr().err
    assert not (tmp_path / "run" / "model").exists()


def test_under_torchrun_each_rank_loads_onto_its_own_device(data, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A bare --device cuda was GPU 0 for every rank until Trainer moved the model: bound first, as score does."""
    from gradspec.data import models
    from gradspec.runs import distributed

    bound, loaded = [], []
    monkeypatch.setattr(distributed, "bind_device", lambda device: bound.append(device) or "cpu")
    real = models.load_model
    monkeypatch.setattr(models, "load_model", lambda name, device, *a, **k: loaded.append(device) or real(name, device,
                                                                                                         *a, **k))
    args = ["train", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(tmp_path / "run"),
            "--modules", "zzz", "--max-steps", "1"]  # stops after loading, before training
    assert main(args) == 2
    assert bound == ["cpu"] and loaded == ["cpu"]



def test_under_torchrun_the_ranks_save_one_model_and_leave_no_temporary(data, tiny_model_dir, tmp_path):
    """Every rank reaches the save (where a sharded model is gathered, and the ranks agree on rank 0's pid for
    the temporary folder): the run ends with one model/ folder, whole, one monitor file per rank, and no
    model.tmp<pid> left."""
    import subprocess
    import sys

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "gradspec", "train", "--model", str(tiny_model_dir), "--data", str(data),
                           "--out", str(out), "--max-steps", "1", "--batch-size", "2", "--monitor-every", "1"],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["dynamics.parquet", "model", "monitor.rank0.parquet",
                                                      "monitor.rank1.parquet"]
    assert (out / "model" / "model.safetensors").is_file() and (out / "model" / "tokenizer.json").is_file()


def test_the_command_ends_trainer_s_process_group_once_every_rank_is_done(tmp_path, monkeypatch):
    """Under torchrun the command ends the process group Trainer started, after a barrier: a rank that
    exits with it alive may abort in gloo's threads (seen once under load in the test above)."""
    import torch.distributed as dist

    from gradspec.training import train as training

    calls = []
    monkeypatch.setattr(training, "train", lambda config: calls.append("train") or tmp_path)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy"))
    assert main(["train", "--out", str(tmp_path)]) == 0
    assert calls == ["train", "barrier", "destroy"]

# Code run before `gradspec train` in a process that then kills itself (SIGKILL: the OOM killer, a preempted job)
KILLED = {
    "writing monitor rows": """
from gradspec.training import monitor_parts as monitor
write, calls = monitor.write_checksummed, []
def write_checksummed(path, rows):  # the second monitored step dies half-way through its file
    calls.append(1)
    write(path, (lambda f: (f.write(b"PAR1"), f.flush(), die())) if len(calls) == 2 else rows)
monitor.write_checksummed = write_checksummed
""",
    "saving the model": """
import transformers.modeling_utils
def safe_save_file(tensors, filename, *args, **kwargs):
    open(filename, "wb").write(b"half a model")
    die()
transformers.modeling_utils.safe_save_file = safe_save_file
""",
}
LEFT = {"writing monitor rows": "monitor.parquet.parts/ (partial)",
        "saving the model": "dynamics.parquet, monitor.parquet, model.tmp{pid}/ (partial)"}


@pytest.mark.parametrize("moment", KILLED)
def test_the_rerun_of_a_killed_train_names_what_it_left(moment, data, tiny_model_dir, tmp_path, capsys):
    """The refusal listed every output (model, dynamics.parquet, monitor.parquet) whatever was there, and
    a run killed saving its model left a model/ folder like a whole one: the model is now written aside
    (model.tmp<pid>/) and renamed once whole, and the refusal names each file left, partial ones as such."""
    import subprocess
    import sys

    out = tmp_path / "run"
    args = ["train", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(out), "--epochs", "2",
            "--batch-size", "2", "--monitor-every", "2"]
    code = ("import os, signal, sys\ndef die():\n    os.kill(os.getpid(), signal.SIGKILL)\n" + KILLED[moment]
            + "from gradspec.cli import main\nmain(sys.argv[1:])\n")
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.wait(timeout=300) == -signal.SIGKILL
    assert not (out / "model").exists()
    assert main(args) == 2
    left = LEFT[moment].format(pid=proc.pid)
    assert f"--out {out} holds what an earlier run left, stopped before it finished: {left}; pass --overwrite to " \
           "replace them or choose another --out" in capsys.readouterr().err
    if moment == "writing monitor rows":  # the killed run's finished step is readable; the one it cut is not there
        assert read_monitor(out / "monitor.parquet")["step"].unique().tolist() == [2]
    assert main([*args, "--overwrite"]) == 0  # the partial files go with the rest
    assert sorted(p.name for p in out.iterdir()) == ["dynamics.parquet", "model", "monitor.parquet"]


def test_the_refusal_names_each_file_an_earlier_run_left_and_no_other(tmp_path, capsys):
    """A finished run's files as they are (under torchrun one monitor file per rank), not the list of every
    output a run can write; a file of the user's own is none of them."""
    out = tmp_path / "run"
    (out / "model").mkdir(parents=True)
    for name in ("dynamics.parquet", "monitor.rank0.parquet", "monitor.rank1.parquet", "notes.txt"):
        (out / name).write_text("")
    assert main(["train", "--out", str(out)]) == 2
    assert f"--out {out} holds an earlier run's model/, dynamics.parquet, monitor.rank0.parquet, " \
           "monitor.rank1.parquet; pass --overwrite" in capsys.readouterr().err


SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"
# A full disk as the model's weights are written, and what the error then says of it
FULL = {"OSError": (OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
        "safetensors": (SafetensorError(SAFETENSORS_FULL), SAFETENSORS_FULL)}


@pytest.mark.parametrize("raised", FULL)
def test_a_save_on_a_full_disk_leaves_no_model_folder_and_keeps_the_rest(raised, data, tiny_model_dir, tmp_path,
                                                                          monkeypatch, capsys):
    """save_model wrote config.json, then failed on the weights: a model/ folder of config.json alone, as
    if saved. Nothing is at model/ now, the error names it, and what the run computed before is kept.
    safetensors reports a full disk with its own SafetensorError, not an OSError."""
    import transformers.modeling_utils

    error, reason = FULL[raised]

    def full(tensors, filename, *args, **kwargs):
        Path(filename).write_bytes(b"half a model")
        raise error

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    out = tmp_path / "run"
    args = ["train", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(out), "--epochs", "2",
            "--batch-size", "2", "--monitor-every", "2"]
    assert main(args) == 2
    said = f"gradspec: error: {out / 'model'}: {reason}; the model is not saved " \
        "(dynamics.parquet, monitor.parquet kept)"
    assert said in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["dynamics.parquet", "monitor.parquet"]
    assert read_dynamics(out / "dynamics.parquet")[0]["index"].tolist() == list(range(8))
    assert pd.read_parquet(out / "monitor.parquet")["step"].unique().tolist() == [2, 4, 6, 8]


def test_dynamics_on_a_full_disk_lose_not_the_trained_model(data, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """dynamics.parquet is written at the end of training, before the model is saved: a full disk
    there raised out of train() and the trained model was never saved. Now it is, and the error names
    the file that was not written."""
    import gradspec.training.dynamics

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gradspec.training.dynamics, "write_dynamics", full)
    out = tmp_path / "run"
    assert main(["train", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(out), "--epochs", "1",
                 "--batch-size", "2", "--monitor-every", "2"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"gradspec: error: {out / 'dynamics.parquet'}: not written ([Errno 28] No space left on device); the model "
        f"is saved in {out / 'model'}")
    assert (out / "model" / "config.json").exists() and (out / "monitor.parquet").exists()


def test_trainer_arguments_pass_through_to_the_run(data, tiny_model_dir, tmp_path, capsys):
    """--trainer-args reach TrainingArguments as given: accumulation (two micro-batches a monitored step), the
    schedule (constant, not the default linear decay), save and eval steps on --eval-data. The run ends with the
    commands that read what it wrote (it ended on the list of its files)."""
    out = tmp_path / "run"
    args = ["train", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(out), "--batch-size", "2",
            "--max-steps", "2", "--monitor-every", "1", "--learning-rate", "1e-2", "--eval-data", str(data),
            "--trainer-args", "gradient_accumulation_steps=2", "lr_scheduler_type=constant", "save_steps=1",
            "eval_steps=1"]
    assert main(args) == 0
    monitor = pd.read_parquet(out / "monitor.parquet")
    assert monitor.groupby("step")["micro_batch"].apply(sorted).tolist() == [[0, 0, 1, 1]] * 2
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert [r["learning_rate"] for r in state["log_history"] if "loss" in r] == [1e-2, 1e-2]
    assert [r["step"] for r in state["log_history"] if "eval_loss" in r] == [1, 2]
    said = capsys.readouterr().out.splitlines()
    assert said[-3:] == [
        "next:", f"  gradspec report {out / 'monitor.parquet'} --out {out / 'report'}   # its spectra over training",
        f"  gradspec diagnose --base {tiny_model_dir} --model {out / 'model'} --data {data} --dynamics "
        f"{out / 'dynamics.parquet'} --out {out / 'diagnosis'}   # the samples it did not learn, and why"]
    assert (out / "checkpoint-1").is_dir()


@pytest.mark.parametrize(("given", "error"), [
    (["--trainer-args", "learning_rate=1"], "--trainer-args: learning_rate is --learning-rate's to give"),
    (["--trainer-args", "gradient_acumulation_steps=2"],
     "gradient_acumulation_steps is none of TrainingArguments' fields (did you mean gradient_accumulation_steps?)"),
    (["--trainer-args", "eval_steps=2"], "--trainer-args: eval_steps evaluates --eval-data; give it"),
    (["--trainer-args", "lr_scheduler_type=bogus"], "--trainer-args: bogus is not a valid SchedulerType"),
    (["--trainer-args", "bf16"], "--trainer-args 'bf16': expected KEY=VALUE"),
    (["--resume", "last"], "holds no checkpoint-N folder; a run saves them with --trainer-args save_steps=N"),
    (["--loss", "sftmix", "--eval-data", "x.jsonl"], "--eval-data is for --loss ntp and wit"),
    (["--trainer-args", "label_smoothing_factor=0.1"], "label_smoothing_factor: Trainer's label smoother replaces"),
])
def test_trainer_arguments_are_checked_before_the_model_loads(given, error, data, tmp_path, capsys):
    assert main(["train", "--model", "no-such-model", "--data", str(data), "--out", str(tmp_path / "run"),
                 *given]) == 2
    assert error in capsys.readouterr().err


def test_a_stopped_run_resumed_from_its_checkpoint_ends_as_the_run_never_stopped(data, tiny_model_dir, tmp_path,
                                                                               monkeypatch):
    """--resume last: the model, the monitor's rows (those before the checkpoint kept) and the dynamics (the
    epoch measured before it, kept in the checkpoint) equal those of the run that never stopped."""
    from transformers import AutoModelForCausalLM

    from gradspec.training.monitor_callback import SpectralMonitorCallback

    def run(out, *more):
        return main(["train", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(out),
                     "--batch-size", "4", "--max-steps", "4", "--monitor-every", "1", "--learning-rate", "1e-2",
                     "--trainer-args", "save_steps=2", "lr_scheduler_type=constant", *more])

    assert run(tmp_path / "whole") == 0
    begin = SpectralMonitorCallback.on_step_begin

    def stop_at_step_3(self, args, state, control, **kwargs):
        if state.global_step == 2:
            raise KeyboardInterrupt
        return begin(self, args, state, control, **kwargs)

    monkeypatch.setattr(SpectralMonitorCallback, "on_step_begin", stop_at_step_3)
    assert run(tmp_path / "resumed") == 130
    assert not (tmp_path / "resumed" / "model").exists() and (tmp_path / "resumed" / "checkpoint-2").is_dir()
    monkeypatch.setattr(SpectralMonitorCallback, "on_step_begin", begin)
    assert run(tmp_path / "resumed", "--resume", "last") == 0
    whole, resumed = (AutoModelForCausalLM.from_pretrained(tmp_path / d / "model").state_dict()
                      for d in ("whole", "resumed"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    monitors = [pd.read_parquet(tmp_path / d / "monitor.parquet") for d in ("whole", "resumed")]
    assert monitors[1]["step"].tolist() == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    pd.testing.assert_frame_equal(*(m.drop(columns="seconds", errors="ignore") for m in monitors))
    dynamics = [read_dynamics(tmp_path / d / "dynamics.parquet") for d in ("whole", "resumed")]
    assert dynamics[1][1]["checkpoints"] == ["epoch 1", "epoch 2"]
    pd.testing.assert_frame_equal(dynamics[0][0], dynamics[1][0])


def test_a_checkpoint_of_another_folder_is_refused_for_resume(data, tmp_path, capsys):
    """The monitor's rows and the dynamics a resume keeps are out's: a checkpoint elsewhere is not this run's."""
    other = tmp_path / "elsewhere" / "checkpoint-2"
    other.mkdir(parents=True)
    (other / "trainer_state.json").write_text("{}")
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--resume", str(other)]) == 2
    assert "not one of --out" in capsys.readouterr().err
