import re

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import tiny_model

from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.layers import checkpointing
from gradspec.linalg.metrics import METRICS, metrics_from_singular_values
from gradspec.training.monitor import SpectralMonitor
from gradspec.training.monitor_callback import SpectralMonitorCallback
from gradspec.training.monitor_parts import part_files, read_monitor
from gradspec.training.monitor_rows import COLUMN_TYPES
from gradspec.training.sample_index import with_sample_index
from gradspec.training.wit import WITCollator, WITLoss, use_wit_loss, wit_loss

ROWS = [
    {"instruction": "Name a colour.", "output": "Blue."},
    {"instruction": "What is two plus two?", "output": "Four, since two and two make four."},
    {"instruction": "Say something long, please.", "output": "Something long " * 5},
    {"instruction": "Hi", "output": "Hello there, how can I help?"},
]


def _train(model, tokenizer, tmp_path, monitor, accumulation=1, wit=None, collate=None, **args):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4 // accumulation,
                             gradient_accumulation_steps=accumulation, max_steps=2, learning_rate=0.0,
                             remove_unused_columns=False, report_to=[], save_strategy="no", use_cpu=True,
                             **{"logging_steps": 1, **args})
    collator = WITCollator(tokenizer, prompt_weight=0.0 if wit is None else wit.prompt_weight)
    if wit is not None:
        use_wit_loss(model, wit)
    trainer = Trainer(model=model, args=args, train_dataset=ROWS, callbacks=[monitor],
                      data_collator=collator if collate is None else lambda rows: collate(collator(rows)))
    trainer.train()
    return trainer


def _modules(rows: pd.DataFrame) -> list[str]:
    return sorted({c.rsplit("/", 1)[0] for c in rows.columns if c.endswith("/nuclear_norm")})


def _assert_rows_equal(rows: pd.DataFrame, batch: dict, want: dict[int, dict[str, torch.Tensor]], rel: float):
    """Each row against the wanted metrics of the batch sample of its length (the lengths are distinct)."""
    lengths = batch["attention_mask"].sum(1).tolist()
    checked = 0
    for _, row in rows.iterrows():
        i = lengths.index(row["num_tokens"])
        for name, values in want[i].items():
            for k, metric in enumerate(METRICS):
                want_value = pytest.approx(float(values[k]), rel=rel, nan_ok=True)  # NaN: an expert not reached
                assert row[f"{name}/{metric}"] == want_value, (i, name, metric)
                checked += 1
    assert checked > 0


def _assert_losses_equal(rows: pd.DataFrame, batch: dict, want: torch.Tensor):
    """The loss column holds each sample's own loss, as score files do."""
    lengths = batch["attention_mask"].sum(1).tolist()
    for _, row in rows.iterrows():
        assert row["loss"] == pytest.approx(float(want[lengths.index(row["num_tokens"])]), rel=1e-5)


SETUPS = {  # accumulation steps, WIT loss, whether the model takes loss kwargs (num_items_in_batch)
    "ntp": (1, None, True),
    "ntp, accumulated": (2, None, True),
    "wit at lp=0": (1, WITLoss(0.0, 1.0), True),
    "ntp, accumulated, no loss kwargs": (2, None, False),
}


@pytest.mark.parametrize("setup", SETUPS)
def test_monitor_rows_equal_gradspec_score_on_the_same_batch(tokenizer, tmp_path, setup):
    """Learning rate 0 keeps the weights, so every step's batch can be scored afterwards. Without
    loss kwargs the model's loss is its micro-batch's mean, which Trainer divides by the
    accumulation steps."""
    accumulation, wit, loss_kwargs = SETUPS[setup]
    model = tiny_model("llama")
    if not loss_kwargs:
        model.accepts_loss_kwargs = False
    monitor = SpectralMonitorCallback(every=1, modules="all", out=tmp_path / "monitor.parquet")
    trainer = _train(model, tokenizer, tmp_path, monitor, accumulation, wit)
    rows = pd.read_parquet(tmp_path / "monitor.parquet")
    assert rows["step"].tolist() == [1] * 4 + [2] * 4 and rows["scaled"].all()
    assert set(rows["loss_kind"]) == {"ntp" if wit is None else "wit(lp=0,lr=1)"}
    assert (rows["num_loss_tokens"] == rows["num_response_tokens"]).all()
    batch = WITCollator(tokenizer)(ROWS)
    want = SpectralEngine(tiny_model("llama"), "all").score(batch["input_ids"], batch["attention_mask"],
                                                             batch["labels"])
    _assert_rows_equal(rows, batch, {i: {n: v[i] for n, v in want.metrics.items()} for i in range(4)}, 1e-4)
    _assert_losses_equal(rows, batch, want.loss)
    logged = [h for h in trainer.state.log_history if "spectra/q/effective_rank" in h]
    assert len(logged) == 2


def _own_wit_metrics(model, batch: dict, i: int, wit: WITLoss, modules: list[str]) -> dict[str, torch.Tensor]:
    """Sample i alone, with WIT's denominator of that sample: each module's weight gradient by
    autograd, its metrics from a full SVD."""
    n = int(batch["attention_mask"][i].sum())
    model.zero_grad()
    logits = model(input_ids=batch["input_ids"][i : i + 1, :n]).logits
    wit_loss(logits, batch["labels"][i : i + 1, :n], wit.prompt_weight, wit.response_weight).backward()
    return {name: metrics_from_singular_values(torch.linalg.svdvals(model.get_submodule(name).weight.grad.double()))
            for name in modules}


@pytest.mark.parametrize("weights", [(0.5, 1.0), (0.3, 0.8)])
def test_monitor_rows_under_wit_are_each_samples_own_wit_gradient(tokenizer, tmp_path, weights):
    """With prompt weight, a row is the spectrum of the gradient of WIT on the sample alone:
    (lp * its prompt NLL + lr * its response NLL) / (|P_i| + |R_i|), prompt terms included."""
    wit = WITLoss(*weights)
    monitor = SpectralMonitorCallback(every=1, modules="all", out=tmp_path / "monitor.parquet")
    _train(tiny_model("llama"), tokenizer, tmp_path, monitor, wit=wit)
    rows = pd.read_parquet(tmp_path / "monitor.parquet")
    assert len(rows) == 8 and (rows["status"] == "ok").all() and rows["scaled"].all()
    assert set(rows["loss_kind"]) == {f"wit(lp={weights[0]:g},lr={weights[1]:g})"}
    batch = WITCollator(tokenizer, prompt_weight=wit.prompt_weight)(ROWS)
    target = batch["labels"][:, 1:]
    own = ((target != -100).sum(1)).tolist()  # |P_i| + |R_i|, both weights being nonzero
    assert sorted(set(rows["num_loss_tokens"])) == sorted(own)
    assert (rows["num_loss_tokens"] > rows["num_response_tokens"]).all()  # prompt targets are counted
    model = tiny_model("llama")
    want = {i: _own_wit_metrics(model, batch, i, wit, _modules(rows)) for i in range(4)}
    _assert_rows_equal(rows, batch, want, 1e-4)


class _NoKwargs(torch.nn.Module):
    """A model whose forward names its arguments and takes no other (remote code often does)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


@pytest.mark.parametrize("kind", ["list", "Dataset", "own", "model without **kwargs"])
def test_trainer_rows_carry_the_dataset_index_wit_collator_passes(tokenizer, tmp_path, kind):
    """Rows given their index (with_sample_index, of a list or a datasets.Dataset; or their own): WITCollator
    passes it, the monitored steps' rows carry it; on the others it is taken out of the batch too, so that a
    model whose forward takes no **kwargs trains as well."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    rows = {"list": lambda: with_sample_index(ROWS), "Dataset": lambda: with_sample_index(Dataset.from_list(ROWS)),
            "own": lambda: [{**r, "sample_index": 100 + i} for i, r in enumerate(ROWS)],
            "model without **kwargs": lambda: with_sample_index(ROWS)}[kind]()
    model = _NoKwargs(tiny_model("llama")) if kind == "model without **kwargs" else tiny_model("llama")
    first = 100 if kind == "own" else 0
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=4,
                             learning_rate=0.0, remove_unused_columns=False, report_to=[], save_strategy="no",
                             use_cpu=True, logging_steps=2, train_sampling_strategy="sequential")
    Trainer(model=model, args=args, train_dataset=rows, data_collator=WITCollator(tokenizer),
            callbacks=[SpectralMonitorCallback(every=2, out=tmp_path / "m.parquet")]).train()
    got = pd.read_parquet(tmp_path / "m.parquet")
    assert got[["step", "sample_index"]].values.tolist() == [[2, first + 2], [2, first + 3], [4, first + 2],
                                                             [4, first + 3]]


def test_a_stream_is_refused_an_index_of_positions():
    """An IterableDataset's positions restart in each shard and move with every shuffle: not its rows' indices."""
    from datasets import Dataset

    stream = Dataset.from_list(ROWS).to_iterable_dataset(num_shards=2)
    with pytest.raises(TypeError, match="a stream has no stable row positions"):
        with_sample_index(stream)


def test_a_batch_of_rows_with_and_without_an_index_is_refused(tokenizer):
    with pytest.raises(ValueError, match="batch row 1 has no sample_index"):
        WITCollator(tokenizer)([{**ROWS[0], "sample_index": 0}, ROWS[1]])
    with pytest.raises(ValueError, match="batch row 0: sample_index is 0.5"):
        WITCollator(tokenizer)([{**ROWS[0], "sample_index": 0.5}])


def test_monitor_every_n_steps_records_the_steps_trainer_logs(tokenizer, tmp_path):
    monitor = SpectralMonitorCallback(every=2, out=tmp_path / "m.parquet")
    trainer = _train(tiny_model("llama"), tokenizer, tmp_path, monitor, wit=WITLoss(0.5, 1.0), logging_steps=2)
    rows = pd.read_parquet(tmp_path / "m.parquet")
    assert rows["step"].unique().tolist() == [2] and rows["scaled"].all()
    assert (rows["status"] == "ok").all()
    logged = [h["step"] for h in trainer.state.log_history if "spectra/q/effective_rank" in h]
    assert logged == [2]


def _left_padded(batch: dict) -> dict:
    """Each row's padding moved to its start."""
    lengths = batch["attention_mask"].sum(1)
    shifts = (batch["attention_mask"].shape[1] - lengths).tolist()
    return {k: torch.stack([row.roll(s) for row, s in zip(v, shifts, strict=True)]) for k, v in batch.items()}


def _packed(batch: dict) -> dict:
    """Every sample in one row, position ids restarting at each (a padding-free batch)."""
    real = batch["attention_mask"].bool()
    lengths = real.sum(1).tolist()
    return {"input_ids": batch["input_ids"][real][None], "labels": batch["labels"][real][None],
            "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}


def _flash_packed(batch: dict) -> dict:
    """Packed with flash-attention's sequence boundaries, as DataCollatorWithFlattening gives them."""
    packed = _packed(batch)
    bounds = torch.tensor([0, *batch["attention_mask"].sum(1).cumsum(0).tolist()], dtype=torch.int32)
    return {**packed, "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds}


def test_monitor_refuses_left_padded_batches(tokenizer, tmp_path):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="left-padded"):
        _train(model, tokenizer, tmp_path, SpectralMonitorCallback(every=1), collate=_left_padded)
    assert _hooks(model) == 0


def _block_diagonal(packed: dict) -> dict:
    """The packed row's causal mask, block-diagonal over its sequences: the CPU attention kernels do
    not isolate packed sequences from position ids alone."""
    positions = packed["position_ids"][0]
    sequence = torch.cumsum(positions == 0, 0)
    T = len(positions)
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool)) & (sequence[:, None] == sequence[None, :])
    return {**packed, "attention_mask": mask[None, None]}


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("collate", [lambda b: _block_diagonal(_packed(b)),
                                     lambda b: _block_diagonal(_flash_packed(b))], ids=["position ids", "cu_seq_lens"])
def test_packed_batches_give_one_row_per_sequence_equal_to_the_unpacked_batch(tokenizer, tmp_path, collate, kind):
    """The 4 samples packed into one row (sequences isolated by a block-diagonal mask): one row per
    sequence, equal to gradspec score of the same samples unpacked, loss included; MoE experts and
    routers too (each sequence's routed tokens)."""
    out = tmp_path / "m.parquet"
    _train(tiny_model(kind), tokenizer, tmp_path, SpectralMonitorCallback(every=1, modules="all", out=out),
           collate=collate)
    rows = pd.read_parquet(out)
    assert len(rows) == 8 and (rows["status"] == "ok").all() and rows["micro_batch"].eq(0).all()
    batch = WITCollator(tokenizer)(ROWS)
    want = SpectralEngine(tiny_model(kind), "all").score(batch["input_ids"], batch["attention_mask"],
                                                         batch["labels"])
    _assert_rows_equal(rows, batch, {i: {n: v[i] for n, v in want.metrics.items()} for i in range(4)}, 1e-4)
    _assert_losses_equal(rows, batch, want.loss)


def test_a_packed_label_across_a_boundary_is_refused(tmp_path):
    model = tiny_model("llama")
    ids = torch.randint(3, 100, (1, 10))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    with pytest.raises(ValueError, match="first label is not -100"), SpectralMonitor(every=1).step(model):
        model(input_ids=ids, position_ids=positions, labels=ids).loss.backward()
    assert _hooks(model) == 0


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_monitor_rows_under_gradient_checkpointing_equal_rows_without(tokenizer, tmp_path, reentrant, monkeypatch):
    """Trainer's gradient_checkpointing: each module's input comes from the recomputed forward."""
    recomputed = []
    pair = checkpointing.Pairing.recomputed
    monkeypatch.setattr(checkpointing.Pairing, "recomputed", lambda self, *a: recomputed.append(1) or pair(self, *a))
    runs = {}
    for checkpointed in (False, True):
        out = tmp_path / f"{checkpointed}.parquet"
        extra = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": reentrant}} \
            if checkpointed else {}
        _train(tiny_model("llama"), tokenizer, tmp_path, SpectralMonitorCallback(every=1, modules="all", out=out),
               **extra)
        runs[checkpointed] = pd.read_parquet(out)
    assert (runs[True]["status"] == "ok").all() and len(runs[True]) == 8
    assert len(recomputed) == (0 if reentrant else 2 * 7 * 2)  # 2 steps x 7 modules x 2 layers, non-reentrant
    metrics = [c for c in runs[False].columns if "/" in c]
    pd.testing.assert_frame_equal(runs[True][metrics], runs[False][metrics], rtol=1e-6)


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


class _RaiseAt:
    """A callback raising at one step's end (after the monitor's, which comes first)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def __getattr__(self, name):
        return lambda args, state, control, **kwargs: None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError(f"raised at step {self.step}")


def test_a_run_that_raises_leaves_no_hooks_and_a_readable_file(tokenizer, tmp_path):
    from transformers import Trainer, TrainingArguments

    model, out = tiny_model("llama"), tmp_path / "m.parquet"
    monitor = SpectralMonitorCallback(every=1, out=out)
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=4,
                             learning_rate=0.0, remove_unused_columns=False, report_to=[], save_strategy="no",
                             use_cpu=True, logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=ROWS * 2, data_collator=WITCollator(tokenizer),
                      callbacks=[monitor, _RaiseAt(3)])
    with pytest.raises(RuntimeError, match="raised at step 3"):
        trainer.train()
    assert _hooks(model) == 0
    assert read_monitor(out)["step"].unique().tolist() == [1, 2, 3]  # the parts of the run's finished steps
    with pytest.raises(ValueError, match="has parts in .* \\(an unfinished run's rows\\)"):
        Trainer(model=model, args=args, train_dataset=ROWS * 2, data_collator=WITCollator(tokenizer),
                callbacks=[monitor]).train()
    assert _hooks(model) == 0


def _gradspec_hooks(model) -> list:
    """Every hook on the model's modules and parameters whose function is gradspec's."""
    found = []
    for module in model.modules():
        for hooks in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                      module._backward_pre_hooks):
            found += list(hooks.values())
    for parameter in model.parameters():
        found += list((parameter._backward_hooks or {}).values())
        found += list((getattr(parameter, "_post_accumulate_grad_hooks", None) or {}).values())
    return [h for h in found if getattr(h, "__module__", "").startswith("gradspec")]


def _gradspec_calls(run) -> set[str]:
    """The gradspec functions Python enters while run() runs (on this thread: the CPU backward's too)."""
    import sys

    entered = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_globals.get("__name__", "").startswith("gradspec"):
            entered.add(f"{frame.f_globals['__name__']}.{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return entered


@pytest.mark.parametrize(("where", "error"), [("loss", RuntimeError), ("backward", KeyboardInterrupt)])
def test_a_trainer_step_that_raises_leaves_the_model_as_it_was_found(tokenizer, tmp_path, where, error):
    """Trainer calls no callback when train() raises (no on_train_end): the hooks of a monitored step
    whose loss (computed after the model's forward) or backward raised stayed on the user's model until
    its next grad-enabled forward. The callback's guard around Trainer's training_step takes them off
    however the step is left."""
    from transformers import Trainer, TrainingArguments

    class FailingTrainer(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            if self.state.global_step == 1:  # in step 2, monitored, after the forward
                if where == "loss":
                    raise error("the loss failed")
                loss.register_hook(lambda grad: (_ for _ in ()).throw(error("interrupted in the backward")))
            return loss

    model = tiny_model("llama")
    before = _hooks(model)
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=4,
                             learning_rate=0.0, remove_unused_columns=False, report_to=[], save_strategy="no",
                             use_cpu=True, logging_steps=1)
    trainer = FailingTrainer(model=model, args=args, train_dataset=ROWS * 2, data_collator=WITCollator(tokenizer),
                             callbacks=[SpectralMonitorCallback(every=1, modules="all", out=tmp_path / "m.parquet")])
    with pytest.raises(error):
        trainer.train()
    assert _hooks(model) == before and _gradspec_hooks(model) == []
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # no saved-tensor hooks left active
    batch = WITCollator(tokenizer)(ROWS[:2])
    assert _gradspec_calls(lambda: model(**batch).loss.backward()) == set()
    assert read_monitor(tmp_path / "m.parquet")["step"].unique().tolist() == [1]


def test_without_a_trainer_a_step_an_exception_left_loses_its_hooks_at_the_next_forward(tokenizer, tmp_path):
    """A loop calling the callback's events itself has no training_step to guard: a step it leaves by an
    exception it does not report keeps its hooks until the next grad-enabled forward, which finds more
    forwards than the step's micro-batches and takes them off."""
    from types import SimpleNamespace

    model = tiny_model("llama")
    callback = SpectralMonitorCallback(every=1, out=tmp_path / "m.parquet")
    args = SimpleNamespace(gradient_accumulation_steps=1, world_size=1, n_gpu=1, torch_compile=False)
    state = SimpleNamespace(global_step=0)
    callback.on_train_begin(args, state, None, model=model)
    callback.on_step_begin(args, state, None)
    batch = WITCollator(tokenizer)(ROWS[:2])
    model(**batch)  # the loop fails before its backward, and says nothing
    assert _hooks(model) > 0  # what no callback could take off
    model(**batch)
    assert _hooks(model) == 0


def test_a_forward_that_raises_in_a_monitored_step_leaves_no_hooks(tmp_path):
    model = tiny_model("llama")
    monitor = SpectralMonitor(every=1, modules="all", out=tmp_path / "m.parquet")
    ids = torch.randint(3, 100, (2, 9))

    def boom(module, args, output):
        raise RuntimeError("inside the forward")

    handle = model.model.layers[1].mlp.register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="inside the forward"), monitor.step(model):
        model(input_ids=ids, labels=ids).loss.backward()
    handle.remove()
    assert _hooks(model) == 0 and not (tmp_path / "m.parquet").exists()
    with monitor.step(model):
        model(input_ids=ids, labels=ids).loss.backward()
    rows = read_monitor(tmp_path / "m.parquet")
    assert rows["step"].tolist() == [2, 2] and (rows["status"] == "ok").all() and _hooks(model) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_low_precision_model_s_rows_equal_gradspec_score_of_the_same_model(tokenizer, tmp_path, dtype):
    """Both form fp64 Grams from the activations as they are. The training backward carries l_i / N
    where score's carries l_i / n_i, and in bf16/fp16 every op of the backward rounds differently
    at another scale: the rows agree to the dtype's rounding (measured: bf16 <= 2e-2, fp16 <= 3e-3)."""
    model = tiny_model("llama").to(dtype)
    monitor = SpectralMonitor(every=1, modules="all", out=tmp_path / "m.parquet")
    batch = WITCollator(tokenizer)(ROWS)
    with monitor.step(model):
        model(**batch).loss.backward()
    rows = read_monitor(tmp_path / "m.parquet")
    assert (rows["status"] == "ok").all()
    want = SpectralEngine(tiny_model("llama").to(dtype), "all").score(batch["input_ids"], batch["attention_mask"],
                                                                       batch["labels"])
    rel = 5e-2 if dtype == torch.bfloat16 else 1e-2
    _assert_rows_equal(rows, batch, {i: {n: v[i] for n, v in want.metrics.items()} for i in range(4)}, rel)


def test_a_plain_loop_s_rows_equal_gradspec_score(tokenizer, tmp_path):
    """Any loop: ``with monitor.step(model)`` around its forward and backward, a mean loss over
    micro-batches of 2 accumulated, dataset indices from a batch column the monitor takes out."""
    model = tiny_model("llama")
    monitor = SpectralMonitor(every=1, modules="all", out=tmp_path / "m.parquet")
    batch = WITCollator(tokenizer)(ROWS)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with monitor.step(model, accumulation=2):
        for half in (slice(0, 2), slice(2, 4)):
            micro = {k: v[half] for k, v in batch.items()}
            width = int(micro["attention_mask"].sum(1).max())
            micro = {k: v[:, :width] for k, v in micro.items()}
            (model(**micro, sample_index=torch.arange(4)[half] + 10).loss / 2).backward()
    optimizer.step()
    rows = read_monitor(tmp_path / "m.parquet")
    assert sorted(rows["sample_index"]) == [10, 11, 12, 13] and rows["micro_batch"].tolist() == [0, 0, 1, 1]
    want = SpectralEngine(tiny_model("llama"), "all").score(batch["input_ids"], batch["attention_mask"],
                                                             batch["labels"])
    _assert_rows_equal(rows, batch, {i: {n: v[i] for n, v in want.metrics.items()} for i in range(4)}, 1e-4)
    _assert_losses_equal(rows, batch, want.loss)
    assert _hooks(model) == 0


def test_an_accumulated_micro_batch_s_grams_are_freed_when_the_next_forward_begins(tokenizer, tmp_path):
    """Without checkpointing the eigen stage ran at the step's end, so every micro-batch's fp64 Grams stayed
    on the device through the step (tens of GB at 7B shapes): each is reduced when the next forward begins."""
    model = tiny_model("llama")
    monitor = SpectralMonitor(every=1, modules="all", out=tmp_path / "m.parquet")
    batch = WITCollator(tokenizer)(ROWS)
    held = []
    with monitor.step(model, accumulation=2):
        for half in (slice(0, 2), slice(2, 4)):
            (model(**{k: v[half] for k, v in batch.items()}).loss / 2).backward()
            held.append([bool(m.capture.core or m.capture.materialised) for m in monitor._micro])
    assert held == [[True], [False, True]]
    rows = read_monitor(tmp_path / "m.parquet")
    assert len(rows) == 4 and (rows["status"] == "ok").all()


def test_a_ddp_wrapped_model_in_a_plain_loop_gives_the_unwrapped_models_rows(tokenizer, tmp_path):
    """DDP calls its module with the batch; the wrapper has neither the model's loss nor its config (rows
    were unscaled, loss_kind unknown, every column prefixed module.)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        rows = {}
        for wrap in (False, True):
            model = tiny_model("llama")
            looped = torch.nn.parallel.DistributedDataParallel(model) if wrap else model
            monitor = SpectralMonitor(every=1, modules="attn", out=tmp_path / f"{wrap}.parquet")
            batch = WITCollator(tokenizer)(ROWS[:2])
            with monitor.step(looped):
                looped(**batch).loss.backward()
            rows[wrap] = read_monitor(monitor.out)
        assert rows[True]["loss_kind"].tolist() == rows[False]["loss_kind"].tolist() == ["ntp", "ntp"]
        pd.testing.assert_frame_equal(rows[True], rows[False])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("where", ["hook", "logits"])
def test_a_fault_in_the_monitor_does_not_end_the_training_step(tokenizer, tmp_path, monkeypatch, where):
    """Out of GPU memory forming a Gram in a backward hook (or gathering the logits in the forward) drops
    that micro-batch's spectra, not the user's step: the backward completes, every gradient as without
    the monitor, the rows say monitor_failed, no hook stays."""
    from gradspec.engine.capture import BatchCapture
    from gradspec.training import monitor_loss

    calls = []
    real = BatchCapture.on_part

    def third_part_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(*args, **kwargs)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    if where == "hook":
        monkeypatch.setattr(BatchCapture, "on_part", third_part_fails)
    else:
        monkeypatch.setattr(monitor_loss, "sample_losses", out_of_memory)
    batch = WITCollator(tokenizer)(ROWS[:2])
    grads = {}
    for monitored in (True, False):
        model = tiny_model("llama")
        if monitored:
            with SpectralMonitor(every=1, modules="all", out=tmp_path / "m.parquet").step(model):
                model(**batch).loss.backward()
        else:
            model(**batch).loss.backward()
        grads[monitored] = {n: p.grad.clone() for n, p in model.named_parameters()}
        assert _hooks(model) == 0
    assert grads[True].keys() == grads[False].keys()
    assert all(torch.equal(grads[True][n], grads[False][n]) for n in grads[False])
    rows = read_monitor(tmp_path / "m.parquet")
    assert rows["status"].str.contains("monitor_failed").all()


def test_a_compiled_model_is_refused_before_its_step(tmp_path):
    """Its graph skips hooks added after compilation: no rows and no warning, or a failure inside the step."""
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="cannot hook a torch.compile'd model"):
        with SpectralMonitor(every=1, out=tmp_path / "m.parquet").step(torch.compile(model)):
            pass
    from types import SimpleNamespace

    from gradspec.training.monitor_callback import refuse_unmonitorable
    with pytest.raises(ValueError, match="torch_compile=False"):
        refuse_unmonitorable(SimpleNamespace(n_gpu=1, torch_compile=True))


@pytest.mark.parametrize(("make", "message"), [
    (lambda: SpectralMonitor(every=0), "every: a whole number of steps, at least 1; got 0"),
    (lambda: SpectralMonitor(every="2"), "every: a whole number of steps, at least 1; got '2'"),
    (lambda: SpectralMonitor(out="mon.jsonl"), "out mon.jsonl: name a .parquet file to write"),
    (lambda: SpectralMonitor(backend="zz"), "backend must be 'auto', 'cpp' or 'torch', got 'zz'"),
    (lambda: SpectralMonitorCallback(every=0), "every: a whole number of steps, at least 1; got 0"),
    (lambda: WITLoss(-1, 1), "prompt_weight must be a number >= 0, got -1"),
    (lambda: WITLoss(0, 0), "prompt_weight and response_weight are both 0: nothing to learn from"),
    (lambda: WITLoss("0.3"), "prompt_weight must be a number >= 0, got '0.3'"),
])
def test_bad_arguments_are_named_when_given(make, message):
    """Not at the first monitored step or the first loss, in the middle of the user's training."""
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


def test_packed_sequences_from_position_ids_or_cu_seq_lens():
    from gradspec.training.monitor_layout import packed_sequences

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 9, 9, 9]])
    mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])  # the second row right-padded after its sequences
    assert packed_sequences({"position_ids": positions, "attention_mask": mask}, (2, 9)) == [
        (0, 0, 3), (0, 3, 2), (0, 5, 4), (1, 0, 2), (1, 2, 4)]
    bounds = torch.tensor([0, 4, 6, 9], dtype=torch.int32)
    assert packed_sequences({"cu_seq_lens_q": bounds}, (1, 9)) == [(0, 0, 4), (0, 4, 2), (0, 6, 3)]
    assert packed_sequences({"position_ids": torch.arange(9)[None].expand(2, 9)}, (2, 9)) is None


def test_a_resumed_run_with_other_modules_keeps_both_columns(tokenizer, tmp_path):
    """A run resumed at step 1 with other modules: the earlier rows keep their columns, the later ones add
    theirs (before, the file's first columns governed and the new metrics were dropped without a word)."""
    model, batch = tiny_model("llama"), WITCollator(tokenizer)(ROWS[:2])
    first = SpectralMonitor(every=1, modules="q", out=tmp_path / "m.parquet")
    for step in (1, 2):
        with first.step(model, step):
            model(**batch).loss.backward()
    del first  # its process killed: its folder's lock goes with it
    resumed = SpectralMonitor(every=1, modules="k", out=tmp_path / "m.parquet")
    resumed.restart(resumed_at=1)
    with resumed.step(model, 2):
        model(**batch).loss.backward()
    q, k = "model.layers.0.self_attn.q_proj/nuclear_norm", "model.layers.0.self_attn.k_proj/nuclear_norm"
    unfinished = read_monitor(tmp_path / "m.parquet")  # the parts, joined by whoever reads them
    resumed.close()  # and the file they are compacted into
    for rows in (unfinished, pd.read_parquet(tmp_path / "m.parquet")):
        assert rows["step"].tolist() == [1, 1, 2, 2]
        assert rows[q].notna().tolist() == [True, True, False, False] and rows[k].notna().tolist() == [False, False,
                                                                                                       True, True]



# Output: a part per monitored step in <out>.parts/, compacted into out at the run's end.

def _steps(monitor: SpectralMonitor, model, tokenizer, steps: list[int]) -> list[list[dict]]:
    """Monitored steps of a plain loop (no optimizer: the weights stay), each on other rows; each step's rows."""
    written = []
    for step in steps:
        batch = WITCollator(tokenizer)(ROWS[step % 3 : step % 3 + 2])
        monitor.begin(model, step)
        model(**batch).loss.backward()
        written.append(monitor.end())
    return written


class _WholeFile(SpectralMonitor):
    """The writer the parts replaced, the reference: every row so far rewritten whole at each step."""

    table = None

    def _write(self, rows):
        schema = pa.schema([(name, COLUMN_TYPES.get(name, pa.float64())) for name in rows[0]])
        table = pa.Table.from_pylist(rows, schema=schema)
        self.table = table if self.table is None else pa.concat_tables([self.table, table],
                                                                       promote_options="permissive")
        pq.write_table(self.table, self.out)


def test_a_multi_step_run_s_file_has_the_rows_the_whole_file_rewrite_wrote(tokenizer, tmp_path):
    """Same columns, types and values as the file rewritten whole at each step; it appears at close,
    compacted from the run's parts, which are then gone. Score readers name read_monitor for it."""
    from gradspec import read_scores
    from gradspec.data.errors import InputError

    model, out = tiny_model("llama"), tmp_path / "m.parquet"
    _steps(_WholeFile(every=1, modules="all", out=tmp_path / "whole.parquet"), model, tokenizer, [1, 2, 3])
    monitor = SpectralMonitor(every=1, modules="all", out=out)
    _steps(monitor, model, tokenizer, [1, 2, 3])
    assert not out.exists() and len(part_files(tmp_path / "m.parquet.parts")) == 3
    monitor.close()
    assert not (tmp_path / "m.parquet.parts").exists()
    got, want = pq.read_table(out), pq.read_table(tmp_path / "whole.parquet")
    assert got.schema == want.schema and got.num_rows == 6 and got.column("step").to_pylist() == [1, 1, 2, 2, 3, 3]
    pd.testing.assert_frame_equal(got.to_pandas(), want.to_pandas())
    with pytest.raises(InputError, match="a training monitor's file \\(gradspec.read_monitor reads it\\)"):
        read_scores(out)


def test_each_step_writes_a_part_of_its_own_rows_alone(tokenizer, tmp_path, monkeypatch):
    """A monitored step's cost stays one step's: each write gets that step's rows alone, as a new part, and
    no earlier row is held (the file was rewritten whole at each step: I/O quadratic in the run's length,
    every row held in memory)."""
    from gradspec.training import monitor_parts

    written, write = [], monitor_parts.write_checksummed

    def spy(path, rows):
        write(path, rows)
        written.append((path.relative_to(tmp_path).as_posix(), pq.read_table(path)["step"].to_pylist()))

    monkeypatch.setattr(monitor_parts, "write_checksummed", spy)
    monitor = SpectralMonitor(every=1, modules="q", out=tmp_path / "m.parquet")
    _steps(monitor, tiny_model("llama"), tokenizer, [1, 2, 3])
    assert written == [(f"m.parquet.parts/0000000{i}.parquet", [i + 1] * 2) for i in range(3)]
    assert not any(isinstance(value, pa.Table) for value in vars(monitor).values())


def test_a_run_stopped_without_close_leaves_parts_that_read_monitor_reads(tokenizer, tmp_path):
    """A run killed, or not closed yet, keeps every finished step: read_monitor reads its parts, from out or
    the folder, a killed write's temporary aside. Score readers name read_monitor, not gradspec merge."""
    from gradspec import read_scores
    from gradspec.data.errors import InputError

    out = tmp_path / "m.parquet"
    rows = [r for step in _steps(SpectralMonitor(every=1, modules="q", out=out), tiny_model("llama"), tokenizer,
                                 [1, 2]) for r in step]
    (tmp_path / "m.parquet.parts" / "00000002.parquet.tmp999").write_bytes(b"PAR1")  # a write killed half-way
    assert not out.exists()
    name = "model.layers.1.self_attn.q_proj/nuclear_norm"
    for path in (out, tmp_path / "m.parquet.parts"):
        got = read_monitor(path)
        assert got["step"].tolist() == [1, 1, 2, 2] and got["num_tokens"].tolist() == [r["num_tokens"] for r in rows]
        assert got[name].tolist() == [r[name] for r in rows]
    with pytest.raises(InputError, match="a training monitor's parts\\? gradspec.read_monitor reads them"):
        read_scores(tmp_path / "m.parquet.parts")


@pytest.mark.parametrize("closed", [False, True], ids=["killed", "closed"])
def test_a_resumed_run_keeps_the_rows_up_to_its_checkpoint(tokenizer, tmp_path, closed):
    """Rows of steps after the checkpoint are dropped (they are trained again), from a killed run's parts or
    a closed run's file; the resumed steps add parts after those kept, and the file at close is the one
    the run would have written without stopping."""
    model, out = tiny_model("llama"), tmp_path / "m.parquet"
    first = SpectralMonitor(every=1, modules="q", out=out)
    whole = [r for step in _steps(first, model, tokenizer, [1, 2, 3, 4]) for r in step]
    if closed:
        first.close()
    del first  # killed, or closed: its folder's lock is gone
    resumed = SpectralMonitor(every=1, modules="q", out=out)
    resumed.restart(resumed_at=2)
    _steps(resumed, model, tokenizer, [3])
    assert read_monitor(out)["step"].tolist() == [1, 1, 2, 2, 3, 3]
    assert [p.name for p in part_files(tmp_path / "m.parquet.parts")] == \
        [f"0000000{i}.parquet" for i in range(2 if closed else 3)]  # the closed run's file is its first part
    _steps(resumed, model, tokenizer, [4])
    resumed.close()
    name = "model.layers.1.self_attn.q_proj/nuclear_norm"
    got = pd.read_parquet(out)
    assert got["step"].tolist() == [1, 1, 2, 2, 3, 3, 4, 4] and got[name].tolist() == [r[name] for r in whole]


def test_a_new_run_refuses_an_unfinished_run_s_parts_unless_overwrite(tokenizer, tmp_path):
    """As an existing file is refused; overwrite removes the parts (a user's own file in the folder stays)."""
    model, out = tiny_model("llama"), tmp_path / "m.parquet"
    _steps(SpectralMonitor(every=1, modules="q", out=out), model, tokenizer, [1, 2])
    (tmp_path / "m.parquet.parts" / "notes.txt").write_text("mine")
    refused = SpectralMonitor(every=1, modules="q", out=out)
    for step in (1, 2):  # and again at its next step: nothing of the earlier run written over
        with pytest.raises(ValueError, match=r"m\.parquet\.parts \(an unfinished run's rows\); give another path "
                                             r"or overwrite=True"):
            _steps(refused, model, tokenizer, [step])
    assert read_monitor(out)["step"].tolist() == [1, 1, 2, 2]
    again = SpectralMonitor(every=1, modules="q", out=out, overwrite=True)
    _steps(again, model, tokenizer, [5])
    again.close()
    assert read_monitor(out)["step"].tolist() == [5, 5]
    assert [p.name for p in (tmp_path / "m.parquet.parts").iterdir()] == ["notes.txt"]


def test_compaction_writes_the_parts_concatenated_part_by_part(tokenizer, tmp_path, monkeypatch):
    """One file equal to the parts in order, other columns joined (a run resumed with other modules), written
    in row groups of about GROUP_BYTES: the parts are never all in memory at once."""
    from gradspec.files import parts as file_parts
    from gradspec.training import monitor_parts

    model, out = tiny_model("llama"), tmp_path / "m.parquet"
    _steps(SpectralMonitor(every=1, modules="q", out=out), model, tokenizer, [1, 2])
    resumed = SpectralMonitor(every=1, modules="k", out=out)
    resumed.restart(resumed_at=2)
    _steps(resumed, model, tokenizer, [3])
    parts = [pq.read_table(p) for p in part_files(tmp_path / "m.parquet.parts")]
    monkeypatch.setattr(file_parts, "GROUP_BYTES", 1)  # a row group per part
    monkeypatch.setattr(monitor_parts, "READ_TOGETHER", 1)
    resumed.close()
    got, want = pq.ParquetFile(out), pa.concat_tables(parts, promote_options="permissive")
    assert got.num_row_groups == 3 and got.schema_arrow == want.schema
    pd.testing.assert_frame_equal(got.read().to_pandas(), want.to_pandas())


def test_each_rank_writes_its_own_parts_and_file(tokenizer, tmp_path, monkeypatch):
    """Under torch.distributed each rank's parts and file carry its rank: no rank writes over another's."""
    from types import SimpleNamespace

    from gradspec.training import monitor as monitor_module

    model, out = tiny_model("llama"), tmp_path / "m.parquet"
    monitors = []
    for rank in (0, 1):
        monkeypatch.setattr(monitor_module, "dist", SimpleNamespace(
            is_available=lambda: True, is_initialized=lambda: True, get_world_size=lambda: 2,
            get_rank=lambda rank=rank: rank))
        monitors.append(SpectralMonitor(every=1, modules="q", out=out))
        _steps(monitors[-1], model, tokenizer, [1 + rank])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.rank0.parquet.parts", "m.rank1.parquet.parts"]
    for monitor in monitors:
        monitor.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.rank0.parquet", "m.rank1.parquet"]
    assert [pd.read_parquet(tmp_path / f"m.rank{r}.parquet")["step"].tolist() for r in (0, 1)] == [[1, 1], [2, 2]]


def test_a_compaction_that_fails_keeps_the_parts(tokenizer, tmp_path, monkeypatch, caplog):
    """A full disk at the run's end is logged, not raised into the finished training; the rows stay readable."""
    from gradspec.files import parts as file_parts

    def full(path, write, before=None):
        raise OSError(28, "No space left on device", str(path))

    out = tmp_path / "m.parquet"
    monitor = SpectralMonitor(every=1, modules="q", out=out)
    _steps(monitor, tiny_model("llama"), tokenizer, [1])
    monkeypatch.setattr(file_parts, "atomic_write", full)
    monitor.close()
    assert "not compacted into" in caplog.text
    assert not out.exists() and read_monitor(out)["step"].tolist() == [1, 1]
