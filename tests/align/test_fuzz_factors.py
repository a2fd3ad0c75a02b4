"""Random damage to a K-FAC/EK-FAC factors file, read as align reads it (KFACFactors.load, then the
damped inverses): nothing escapes but one line of OptionInputError naming the file (issue 49: list
metadata ended in AttributeError, NaN or negated factors in torch's Cholesky error naming no file, an
asymmetric factor was used silently), and factors that are accepted give finite inverses. Seeded and
of a fixed size, so it runs in a few seconds, the same cases every time."""

import json
import random
import struct

import pytest
import torch
from conftest import padded_batch, random_sequences, tiny_model
from safetensors import safe_open
from safetensors.torch import save

from gradspec.alignment.kfac import KFACFactors, KroneckerInverse, fit_factors
from gradspec.cli import main
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.errors import InputError
from gradspec.files import write_checksum
from gradspec.options import OptionError

CASES = 240
VOCAB = 500
DAMPING = 0.1
FLAGS = {"factors": "--factors", "damping": "--damping"}
JSON_TEXTS = ["", "{", "[1,2]", "[]", "null", "1", '"text"', "NaN", '{"a": NaN}', '{"a": Infinity}', "[" * 50_000,
              '{"n": ' + "9" * 5000 + "}", '{"x": 1}', '{"x": null}', "\ud800", "{}"]
DTYPES = [torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool, torch.float8_e4m3fn]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The valid files the cases damage, of each kind: {kind: (parts, bytes, tensors, metadata)}, a tiny
    Llama's attention (q, k and v share A: aliases in the metadata)."""
    model = tiny_model("llama", vocab=VOCAB).double()
    engine = SpectralEngine(model, "attn", spectra=False)
    batch = padded_batch(random_sequences([5, 17, 9, 12], VOCAB, seed=6))
    out = {}
    for kind in ("kfac", "ekfac"):
        data = fit_factors(engine.backward_pass, engine.targets, [batch], kind, {"data": "fit.jsonl"}).to_bytes()
        path = tmp_path_factory.mktemp("factors") / f"{kind}.safetensors"
        path.write_bytes(data)
        with safe_open(str(path), "pt") as f:
            out[kind] = engine.parts, data, {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    return out


def _flipped(rng: random.Random, data: bytes, start: int, end: int) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        out[rng.randrange(start, end)] ^= 1 << rng.randrange(8)
    return bytes(out)


def _byte_damage(rng: random.Random, data: bytes) -> bytes:
    """Random bytes, the file cut short, or a few bits flipped in its header, its metadata or its data."""
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    metadata = data.index(b'"__metadata__"')
    kind = rng.randrange(5)
    if kind == 0:
        return rng.randbytes(rng.randrange(200)) if rng.random() < 0.7 else struct.pack("<Q", 2**63) + data[8:]
    if kind == 1:
        return data[: rng.randrange(len(data))]
    if kind == 2:
        return _flipped(rng, data, 0, header_end)
    if kind == 3:
        return _flipped(rng, data, metadata, header_end)
    return _flipped(rng, data, header_end, len(data))


def _tensor_damage(rng: random.Random, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One tensor with NaN or inf in it, of another shape or dtype, negated; a factor asymmetric, negative
    definite or indefinite."""
    tensors = dict(tensors)
    key = rng.choice(sorted(tensors))
    t = tensors[key].clone()
    kind = rng.randrange(7) if key.endswith((".A", ".S")) else rng.randrange(4)
    n, eye = len(t), torch.eye(len(t), dtype=t.dtype)
    if kind == 0:
        t.view(-1)[rng.randrange(t.numel())] = rng.choice([float("nan"), float("inf"), -float("inf")])
    elif kind == 1:
        t = rng.choice([t[:-1], t.T[:, 1:], t.reshape(-1), t[None], t[:0], t[0, 0], torch.cat([t, t])])
    elif kind == 2:
        t = t.to(rng.choice(DTYPES))
    elif kind == 3:
        t = -t
    elif kind == 4:
        i, j = rng.sample(range(n), 2)
        t[i, j] += rng.choice([1e-3, 1.0, -5.0]) * float(t.abs().max())
    elif kind == 5:
        t = t - rng.choice([0.5, 2.0]) * t.diagonal().max() * eye
    else:
        t = eye + rng.choice([2.0, 50.0]) * (torch.ones_like(t) - eye)
    tensors[key] = t.contiguous()
    return tensors


def _metadata_damage(rng: random.Random, metadata: dict[str, str]) -> dict[str, str]:
    """A field missing, of another type, not JSON, or naming what the file does not hold."""
    metadata = dict(metadata)
    field = rng.choice(["format", "kind", "provenance", "aliases"])
    kind = rng.randrange(4)
    if kind == 0:
        del metadata[field]
    elif kind == 1:
        metadata[field] = rng.choice(JSON_TEXTS)
    elif kind == 2:
        metadata[field] = rng.choice(["kfac", "ekfac", "gradspec-kfac-0", "K-FAC"])
    else:
        aliases = json.loads(metadata["aliases"])
        aliases[rng.choice(["x.A", *aliases])] = rng.choice(["nowhere.A", 3, None, ["a"], *aliases.values()])
        metadata["aliases"] = json.dumps(aliases)
    return metadata


def _case(rng: random.Random, base: dict) -> tuple[list, bytes, bool]:
    """(parts, the file's bytes, whether its checksum is written beside it: the bytes as written)."""
    parts, data, tensors, metadata = base[rng.choice(["kfac", "ekfac"])]
    kind = rng.randrange(4)
    if kind == 0:
        return parts, _byte_damage(rng, data), False
    if kind == 1:
        return parts, save(_tensor_damage(rng, tensors), metadata=metadata), rng.random() < 0.5
    if kind == 2:
        return parts, save(tensors, metadata=_metadata_damage(rng, metadata)), rng.random() < 0.5
    return parts, data, False


def _read(path, parts) -> str | None:
    """Reads path as align does; None where it is accepted (its inverses finite), else the refusal's line."""
    try:
        inverses = KFACFactors.load(path, parts).inverses(DAMPING)
    except InputError as e:
        message = e.named(FLAGS) if isinstance(e, OptionError) else str(e)
        assert "\n" not in message and message.startswith(f"--factors {path}: "), message
        return message
    for inverse in inverses.values():
        held = (inverse.A_inv, inverse.S_inv) if isinstance(inverse, KroneckerInverse) else (inverse.denominator,)
        assert all(torch.isfinite(t).all() for t in held)
    return None


# What the cases must have met, so that the generators keep reaching each check
MET = ["cannot read the K-FAC factors", "not a factors file gradspec wrote", "metadata 'aliases'",
       "metadata 'provenance'", "metadata 'kind'", "not valid JSON", "expected a JSON object", "holds NaN or infinite",
       "not float32 or float64", "of shape", "not symmetric", "negative diagonal entry", "not positive definite even "
       "damped", "a negative eigenvalue", "checksum mismatch"]


def test_damaged_factors_files_meet_only_one_line_refusals(tmp_path, base):
    rng = random.Random("gradspec-fuzz-factors")
    refusals, accepted = [], 0
    for case in range(CASES):
        parts, data, checksummed = _case(rng, base)
        path = tmp_path / f"{case}.safetensors"
        if checksummed or rng.random() < 0.1:  # else read with a warning: the parser meets the damage
            path.write_bytes(data if checksummed else base["kfac"][1])
            write_checksum(path)
        path.write_bytes(data)
        message = _read(path, parts)
        accepted += message is None
        refusals += [message] if message else []
    for said in MET:
        assert any(said in m for m in refusals), f"no case met {said!r}"
    assert accepted > 0  # some damage leaves the factors usable (a flipped low bit, a field left out)


def test_align_meets_a_damaged_factors_file_with_one_line(tmp_path, tiny_model_dir, base, capsys):
    pool, task = tmp_path / "pool.jsonl", tmp_path / "task.jsonl"
    pool.write_text('{"instruction": "What is 2+2?", "output": "4"}\n')
    task.write_text('{"instruction": "What is 7+1?", "output": "8"}\n')
    factors = tmp_path / "factors.safetensors"
    factors.write_bytes(random.Random("gradspec-fuzz-factors-cli").randbytes(300))
    assert main(["align", "--data", str(pool), "--target", str(task), "--model", str(tiny_model_dir), "--quiet",
                 "--precondition", "kfac", "--factors", str(factors), "--out", str(tmp_path / "a.parquet")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"gradspec: error: --factors {factors}: cannot read the K-FAC factors")
    assert all("no checksum beside it" in line for line in err[:-1])  # the warning, the one other line
