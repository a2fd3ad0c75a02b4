"""A K-FAC/EK-FAC factors file as align reads and writes it (issue 49): a --config file may name one to
read, never one to write; its metadata and every factor are checked where it is read, each refusal one
line naming the file and the field or tensor; its checksum is written beside it and checked."""

import json
import os

import pytest
import torch
from conftest import padded_batch, random_sequences, tiny_model
from safetensors import safe_open
from safetensors.torch import save

from gradspec.alignment.kfac import KFACFactors, fit_factors
from gradspec.cli import main
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.errors import OptionInputError
from gradspec.files import checksum_path

VOCAB = 500
FLAGS = {"factors": "--factors", "damping": "--damping"}
POOL = [{"instruction": "Write a haiku about rain.", "output": "Soft rain on the roof."},
        {"instruction": "What is 2+2?", "output": "4"}, {"instruction": "Name a prime.", "output": "Seven."}]
TASK = [{"instruction": "What is 7+1?", "output": "8"}, {"instruction": "Compute 6 times 2.", "output": "12"}]


@pytest.fixture(scope="module")
def fitted():
    """(parts, EK-FAC factors) of a tiny Llama's attention: q, k and v share A (an alias in the file)."""
    model = tiny_model("llama", vocab=VOCAB).double()
    engine = SpectralEngine(model, "attn", spectra=False)
    batch = padded_batch(random_sequences([5, 17, 9, 12], VOCAB, seed=4))
    return engine.parts, fit_factors(engine.backward_pass, engine.targets, [batch], "ekfac", {"data": "fit.jsonl"})


def _contents(factors: KFACFactors, tmp_path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of the file save writes, to change and write again."""
    path = tmp_path / "base.safetensors"
    path.write_bytes(factors.to_bytes())
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _refusal(path, parts, damping: float | None = None) -> str:
    with pytest.raises(OptionInputError) as caught:
        factors = KFACFactors.load(path, parts)
        if damping is not None:
            factors.inverses(damping)
    message = caught.value.named(FLAGS)
    assert "\n" not in message and message.startswith(f"--factors {path}: "), message
    return message


@pytest.mark.parametrize(("field", "text", "said"), [
    ("aliases", "[1,2]", "metadata 'aliases': expected a JSON object, got list [1, 2]"),
    ("provenance", "[]", "metadata 'provenance': expected a JSON object, got list []"),
    ("provenance", "{", "metadata 'provenance': not valid JSON (Expecting property name"),
    ("provenance", '{"examples": NaN}', "metadata 'provenance': not valid JSON (NaN is not JSON)"),
    ("aliases", "[" * 100_000, "metadata 'aliases': not valid JSON (maximum recursion depth"),
    ("aliases", '{"x.A": 1}', "metadata 'aliases': 'x.A' -> 1, not a tensor of the file"),
    ("kind", "fisher", "metadata 'kind': 'fisher', not one of kfac, ekfac"),
])
def test_factors_metadata_of_the_wrong_type_is_refused_naming_the_file_and_field(tmp_path, fitted, field, text,
                                                                                  said):
    """D8: aliases="[1,2]" ended in AttributeError, provenance="[]" in one later, invalid JSON named no file."""
    parts, factors = fitted
    tensors, meta = _contents(factors, tmp_path)
    path = tmp_path / "factors.safetensors"
    path.write_bytes(save(tensors, metadata={**meta, field: text}))
    assert said in _refusal(path, parts)


def _negated(t: torch.Tensor) -> torch.Tensor:
    return -t


def _indefinite(t: torch.Tensor) -> torch.Tensor:
    """Symmetric, a positive diagonal, and an eigenvalue far below zero: only the Cholesky finds it."""
    return torch.eye(len(t), dtype=t.dtype) + 2 * (torch.ones_like(t) - torch.eye(len(t), dtype=t.dtype))


@pytest.mark.parametrize(("change", "said"), [
    (lambda t: t.index_put((torch.tensor([1]), torch.tensor([2])), torch.tensor(float("nan"), dtype=t.dtype)),
     "holds NaN or infinite values"),
    (lambda t: t * float("inf"), "holds NaN or infinite values"),
    (_negated, "not positive semi-definite (a negative diagonal entry)"),
    (lambda t: t.half(), "float16, not float32 or float64 (gradspec writes float64)"),
    (lambda t: t.long(), "int64, not float32 or float64"),
    (lambda t: t + torch.triu(torch.full_like(t, 1e-3 * float(t.abs().max())), 1), "not symmetric"),
    (lambda t: t[:-1], "no A of shape (64, 64)"),
])
def test_bad_factor_values_are_refused_where_they_are_read_naming_the_file_and_tensor(tmp_path, fitted, change,
                                                                                      said):
    """D9a: NaN, negated, fp16 and int64 factors ended in torch's 'linalg.cholesky: ... not positive-definite'
    naming no file; an asymmetric factor was used silently."""
    parts, factors = fitted
    tensors, meta = _contents(factors, tmp_path)
    key = f"{parts[0].name}.A"
    tensors[key] = change(tensors[key]).contiguous()
    path = tmp_path / "factors.safetensors"
    path.write_bytes(save(tensors, metadata={**meta, "kind": "kfac"}))
    message = _refusal(path, parts, damping=0.1)
    assert said in message and parts[0].name in message


def test_an_ekfac_eigenvalue_below_zero_is_refused(tmp_path, fitted):
    parts, factors = fitted
    tensors, meta = _contents(factors, tmp_path)
    key = f"{parts[-1].name}.eigenvalues"
    tensors[key] = -tensors[key]
    path = tmp_path / "factors.safetensors"
    path.write_bytes(save(tensors, metadata=meta))
    assert f"{key}: a negative eigenvalue" in _refusal(path, parts, damping=0.1)


def test_a_factor_the_damped_cholesky_cannot_invert_names_the_file_the_key_and_the_damping(tmp_path, fitted):
    parts, factors = fitted
    tensors, meta = _contents(factors, tmp_path)
    key = f"{parts[-1].name}.S"
    tensors[key] = _indefinite(tensors[key])
    path = tmp_path / "factors.safetensors"
    path.write_bytes(save(tensors, metadata={**meta, "kind": "kfac"}))
    KFACFactors.load(path, parts)  # symmetric, finite, a positive diagonal: only its inverse shows it
    message = _refusal(path, parts, damping=0.1)
    assert f"{key}: not positive definite even damped (--damping 0.1): raise --damping" in message


def test_factors_are_saved_with_their_checksum_and_bytes_that_differ_are_refused(tmp_path, fitted):
    """D9b: the SHA-256 was recorded in the score file but never checked when the factors were read again:
    a flipped byte in the data was used silently."""
    parts, factors = fitted
    path = tmp_path / "factors.safetensors"
    assert factors.save(path)
    assert checksum_path(path).read_text() and KFACFactors.load(path, parts).kind == "ekfac"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # the last float's low mantissa bits: a value a little off, nothing else shows it
    path.write_bytes(bytes(data))
    assert "its bytes differ from those written (checksum mismatch)" in _refusal(path, parts)


def test_factors_without_a_checksum_are_read_with_a_warning(tmp_path, fitted, caplog):
    parts, factors = fitted
    path = tmp_path / "factors.safetensors"
    path.write_bytes(factors.to_bytes())  # as an earlier gradspec wrote them
    back = KFACFactors.load(path, parts)
    assert back.provenance == factors.provenance
    assert f"{path}: no checksum beside it (factors.safetensors.sha256): read unchecked" in caplog.text


def test_a_fifo_where_the_factors_should_be_is_refused_without_blocking(tmp_path, fitted):
    parts, _ = fitted
    path = tmp_path / "factors.safetensors"
    os.mkfifo(path)
    assert _refusal(path, parts).endswith("a FIFO (named pipe), not a regular file; a K-FAC factors file "
                                          "(.safetensors)")


def test_saving_never_replaces_a_file(tmp_path, fitted):
    parts, factors = fitted
    path = tmp_path / "factors.safetensors"
    path.write_bytes(b"someone's file")
    assert not factors.save(path)
    assert path.read_bytes() == b"someone's file" and not checksum_path(path).exists()


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_config_file_may_name_factors_to_read_but_never_where_they_are_written(tmp_path, tiny_model_dir, capsys,
                                                                               monkeypatch):
    """D6: a --config file holding factors: <a path elsewhere> made align create the factors file there."""
    pool, task = _write_jsonl(tmp_path / "pool.jsonl", POOL), _write_jsonl(tmp_path / "task.jsonl", TASK)
    (tmp_path / "elsewhere").mkdir()
    planted = tmp_path / "elsewhere" / "planted.safetensors"
    config = tmp_path / "run.yaml"
    config.write_text(f"data: {pool}\ntarget: {task}\nmodel: {tiny_model_dir}\nmax-length: 64\nquiet: true\n"
                      f"precondition: kfac\nfactors: {planted}\n")
    run = ["align", "--config", str(config)]
    assert main([*run, "--out", str(tmp_path / "a.parquet")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"gradspec: error: --config {config}: 'factors': {planted}: no such file; a file may name one for "
                   "the run to read, never one for it to write (where a run writes is the command line's alone): pass "
                   "--factors on the command line to have it write the factors it fits there")
    assert not planted.exists() and not (tmp_path / "a.parquet").exists()

    assert main([*run, "--factors", str(planted), "--out", str(tmp_path / "b.parquet")]) == 0
    out = capsys.readouterr().out
    assert f"wrote the kfac factors it fitted to {planted}: a later run given --factors {planted} reads them" in out
    assert planted.is_file() and checksum_path(planted).is_file()

    def refit(*args, **kwargs):
        raise AssertionError("the factors file was there: nothing to fit")

    monkeypatch.setattr("gradspec.runs.preconditioning.fit_factors", refit)
    written = planted.read_bytes()
    assert main([*run, "--out", str(tmp_path / "c.parquet")]) == 0  # the file names factors that exist: read
    assert "wrote the kfac factors" not in capsys.readouterr().out and planted.read_bytes() == written


def test_align_refuses_a_factors_file_whose_bytes_changed(tmp_path, tiny_model_dir, capsys):
    pool, task = _write_jsonl(tmp_path / "pool.jsonl", POOL), _write_jsonl(tmp_path / "task.jsonl", TASK)
    factors = tmp_path / "factors.safetensors"
    run = ["align", "--data", str(pool), "--target", str(task), "--model", str(tiny_model_dir), "--max-length", "64",
           "--quiet", "--precondition", "kfac", "--factors", str(factors)]
    assert main([*run, "--out", str(tmp_path / "a.parquet")]) == 0
    data = bytearray(factors.read_bytes())
    data[-3] ^= 0x01
    factors.write_bytes(bytes(data))
    capsys.readouterr()
    assert main([*run, "--out", str(tmp_path / "b.parquet")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"gradspec: error: --factors {factors}: damaged, its bytes differ from those written (checksum mismatch); fit "
        "them again (another --factors path)")
