"""The precision policy on SmolLM2's real gradients: every path forced in turn agrees with the
full-SVD reference at its precision's stated tolerance, a rank-deficient sample included."""

import pytest
import torch
from conftest import FP32_RTOL, FP64_RTOL, FakeCupy, padded_batch

from gradspec.data.readers import humaneval_samples
from gradspec.data.templates import tokenize
from gradspec.engine.reference import reference_scores
from gradspec.engine.spectral_engine import SpectralEngine
from gradspec.linalg import extension, grams, solvers, stages
from gradspec.linalg.metrics import METRICS

MODULES = "*.layers.0.self_attn.*,*.layers.29.self_attn.*"


@pytest.fixture(scope="module")
def problem(smol):
    """HumanEval 2 (90 tokens: T x T core), a response of one repeated token (rank-deficient X at
    layer 0) and HumanEval 1 (> 192 tokens: k/v through the materialised G), with references."""
    model, tok = smol
    repeated = [{"role": "user", "content": "Say ha many times."}, {"role": "assistant", "content": " ha" * 40}]
    conversations = [s.messages for s in humaneval_samples(3) if s.index in (2, 1)][::-1] + [repeated]
    seqs = []
    for messages in conversations[:1] + conversations[2:] + conversations[1:2]:
        t = tokenize(messages, tok, "plain", 2048)
        seqs.append((torch.tensor(t.input_ids), torch.tensor(t.labels)))
    assert len(seqs[1][0]) < 192 < len(seqs[2][0])
    references = [reference_scores(model, ids, labels, MODULES)[1] for ids, labels in seqs]
    return model, tok, seqs, references


def _worst_errors(scores, references) -> dict[str, float]:
    worst = dict.fromkeys(METRICS, 0.0)
    for i, reference in enumerate(references):
        assert scores.status(i) == "ok"
        for name, values in reference.items():
            for j, metric in enumerate(METRICS):
                error = abs(scores.metrics[name][i, j].item() - values[metric]) / abs(values[metric])
                worst[metric] = max(worst[metric], error)
    return worst


FP64_PATHS = [
    pytest.param({"segment_gram": "cpp", "product_gram": "cpp", "core": "cpp", "gram": "cpp"}, id="cpp",
                 marks=pytest.mark.skipif(not extension.BUILT, reason="no _C")),
    pytest.param({"segment_gram": "torch", "product_gram": "torch", "core": "torch", "gram": "torch"}, id="torch"),
    pytest.param({"segment_gram": "torch", "product_gram": "torch", "core": "cupy", "gram": "cupy"}, id="cupy"),
]


@pytest.mark.parametrize("force", FP64_PATHS)
def test_every_fp64_path_is_exact(problem, force, monkeypatch):
    model, tok, seqs, references = problem
    if "cupy" in force.values():  # CuPy's eigensolver over NumPy, offered as on a GPU
        monkeypatch.setattr(stages, "on_gpu", lambda t: True)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0}))
        monkeypatch.setattr(solvers, "cupy_eigen", lambda: solvers.eigensolver_via(FakeCupy, FakeCupy.errstate))
    engine = SpectralEngine(model, MODULES, precision="fp64", force=force)
    worst = _worst_errors(engine.score(*padded_batch(seqs, tok.pad_token_id)), references)
    assert max(worst.values()) < FP64_RTOL, worst
    assert engine.policy.describe() == {"precision": "fp64", "paths": {s: [p] for s, p in sorted(force.items())}}


@pytest.mark.parametrize("gram_path", ["torch", "triton"])
def test_fp32_paths_stay_within_the_stated_tolerance(problem, gram_path):
    """fp32 Grams (torch, or the Triton kernel under the interpreter) on the two shorter samples."""
    model, tok, seqs, references = problem
    engine = SpectralEngine(model, MODULES, precision="fp32", force={"segment_gram": gram_path})
    worst = _worst_errors(engine.score(*padded_batch(seqs[:2], tok.pad_token_id)), references[:2])
    assert all(worst[m] < FP32_RTOL[m] for m in METRICS), worst
    assert engine.policy.describe()["paths"]["segment_gram"] == [gram_path]


def test_fp32_is_never_measured_against_fp64():
    """Each precision's stages list only paths of that precision: at fp64 the Triton Gram is the
    fp64 segment SYRK (its output fp64 whatever it reads), the fp32 sketch kernel is no path, and
    the extension's fp64 Gram is no fp32 one."""
    from gradspec.linalg.policy import Policy

    Y = torch.zeros(2, 8, 4)
    assert "triton" in stages.paths("segment_gram", Y, Policy("fp64"))  # TRITON_INTERPRET=1 here
    forced = Policy("fp64", force={"segment_gram": "triton"})
    assert grams.segment_gram(Y.bfloat16(), torch.tensor([8, 3]), policy=forced)[0].dtype == torch.float64
    assert "triton" not in stages.paths("segment_tdot", Y, Policy("fp64"))
    assert "cpp" not in stages.paths("segment_gram", Y, Policy("fp32"))
    with pytest.raises(ValueError, match="no 'triton' path"):
        grams.segment_tdot(Y, Y, torch.tensor([8, 3]), policy=Policy("fp64", force={"segment_tdot": "triton"}))
    with pytest.raises(ValueError, match="precision"):
        Policy("fp16")


def test_the_score_file_records_the_precision_and_each_stages_paths(tiny_model_dir, tmp_path):
    from gradspec.runs.api import score
    from gradspec.runs.score_files import read_metadata

    out = tmp_path / "scores.parquet"
    score(model=str(tiny_model_dir), out=out, limit=3, progress=False, modules="all")
    meta = read_metadata(out)
    assert meta["precision"] == "fp64"
    want = "cpp" if extension.BUILT else "torch"
    assert "gram" in meta["paths"] and all(paths == [want] for paths in meta["paths"].values()), meta["paths"]


def test_merged_parts_carry_every_path_any_part_took(tmp_path):
    from gradspec.runs.run_folder import RunFolder
    from gradspec.runs.score_files import read_metadata

    folder = RunFolder(tmp_path / "run.parquet")
    folder.start({"model": "m"}, resume=False, overwrite=False)
    for chunk, paths in enumerate([{"core": ["cpp"]}, {"core": ["torch"], "gram": ["cupy"]}]):
        folder.write_part(chunk, [{"index": chunk, "status": "ok"}], {"parts": [], "precision": "fp64", "paths": paths})
    folder.merge(records=2, chunk_rows=1)
    assert read_metadata(tmp_path / "run.parquet")["paths"] == {"core": ["cpp", "torch"], "gram": ["cupy"]}
