import math
import os
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

# Kernels are tested on the CPU through Triton's interpreter; it must be set before triton.jit runs.
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from gradspec.data.batching import pad_batch  # noqa: E402
from gradspec.data.templates import IGNORE_INDEX, Tokenized  # noqa: E402
from gradspec.engine.reference import reference_scores  # noqa: E402

VOCAB = 49152  # SmolLM2's tokenizer, so tiny models can share it


def tiny_model(kind: str, vocab: int = VOCAB, seed: int = 0) -> torch.nn.Module:
    """Small random-init models of each supported layout."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  hidden_size=64, intermediate_size=80, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    if kind == "phi3":
        return Phi3ForCausalLM(Phi3Config(**common)).eval()
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=48, n_layer=2, n_head=4, n_positions=512,
                                          bos_token_id=1, eos_token_id=2)).eval()
    moe = dict(common, intermediate_size=48, num_experts_per_tok=2)
    if kind in MOE_KINDS:
        import transformers

        config_class, model_class, experts = MOE_KINDS[kind]
        config = getattr(transformers, config_class)(**moe, **{experts: 4}, **MOE_EXTRA.get(kind, {}))
        return getattr(transformers, model_class)(config).eval()
    raise ValueError(kind)


# The MoE families transformers implements with fused 3-D experts: config, model, the experts-count key.
MOE_KINDS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "num_experts"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "num_local_experts"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", "num_experts"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", "num_local_experts"),
}
MOE_EXTRA = {"qwen3_moe": {"moe_intermediate_size": 24}, "gpt_oss": {"head_dim": 16}}


@contextmanager
def one_thread():
    """torch at one thread, as each torchrun worker runs: a single-process reference computed alike."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def torchrun(script, *args, processes: int = 2, env: dict | None = None) -> None:
    """The script under torchrun on the CPU (gloo), one thread per worker; its stderr's end on failure."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(processes), str(script), *map(str, args)],
                          env=env or {**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def padded_batch(sequences: list[tuple[torch.Tensor, torch.Tensor]], pad_id: int = 0):
    """Right-pad (input_ids, labels) pairs on the CPU: gradspec's own pad_batch."""
    return pad_batch([Tokenized(x.tolist(), y.tolist(), "ok") for x, y in sequences], pad_id, "cpu")


def random_sequences(lengths: list[int], vocab: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token sequences whose second half is the response."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=g)
        labels = torch.full((n,), IGNORE_INDEX)
        labels[n // 2 :] = ids[n // 2 :]
        out.append((ids, labels))
    return out


def assert_matches_reference(model, scores, sequences, modules, rtol=1e-4, routed=None):
    """Every part's every metric within rtol of the one-sample full-SVD reference. A routed part (an
    expert) a sample never reached has no values (NaN), and its reference gradient is zero; one reached
    only by tokens without gradient (the last) has a zero nuclear norm and undefined ratios, as there.
    routed: the parts that are routed (their names). Returns how many values were compared."""
    from gradspec.linalg.metrics import METRICS

    checked = 0
    for i, (ids, labels) in enumerate(sequences):
        loss, ref, _ = reference_scores(model, ids, labels, modules)
        assert scores.status(i) == "ok"
        assert scores.loss[i].item() == pytest.approx(loss, rel=1e-5)
        assert set(ref) == set(scores.metrics)
        for name, values in ref.items():
            got = dict(zip(METRICS, scores.metrics[name][i, : len(METRICS)].tolist(), strict=True))
            if routed is not None and name in routed and math.isnan(got["nuclear_norm"]):
                assert values["nuclear_norm"] == 0, (i, name, "not reached, but its gradient is not zero")
                assert all(math.isnan(v) for v in got.values()), (i, name, got)
                continue
            for metric in METRICS:
                assert got[metric] == pytest.approx(values[metric], rel=rtol, nan_ok=True), (i, name, metric)
                checked += 1
    assert checked > 0
    return checked


def materialised_gradients(model, sequences, modules) -> list[dict[str, torch.Tensor]]:
    """Each sample's parameter gradient per part (d_out x d_in, fp64), by a backward of its own loss alone."""
    from gradspec.engine.reference import parameter_gradients

    return [parameter_gradients(model, ids, labels, modules)[1] for ids, labels in sequences]


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M-Instruct, real weights (converted from the GGUF once, then cached)."""
    from gradspec.data.models import load_model

    return load_model()


@pytest.fixture(scope="session")
def tokenizer(smol):
    return smol[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A tiny random Llama with SmolLM2's tokenizer, saved like any local model."""
    return _saved(tmp_path_factory, tokenizer, "llama")


def _saved(tmp_path_factory, tokenizer, kind: str):
    """A tiny random model of this kind with SmolLM2's tokenizer, saved in a folder of its own."""
    path = tmp_path_factory.mktemp(f"tiny-{kind}")
    tiny_model(kind).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def one_token_tokenizer():
    """A tokenizer that maps every text to one token (<unk>): no sample has a response token."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                   pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="session")
def one_token_model_dir(tmp_path_factory):
    """A tiny random Llama whose tokenizer maps every text to one token."""
    path = tmp_path_factory.mktemp("one-token")
    tiny_model("llama", vocab=4).save_pretrained(path)
    one_token_tokenizer().save_pretrained(path)
    return path


# The stated tolerances (docs/method.md): fp64 is exact; fp32 Grams square the gradient's condition
# number, so they resolve singular values only down to ~sqrt(d * eps32) of the largest: the norms
# stay close, the tail-sensitive metrics do not. FP32_RTOL holds on short samples (shorter than every
# module's smaller side, as here); on longer ones the tail metrics are further off (docs/method.md).
FP64_RTOL = 1e-4
FP32_RTOL = {"spectral_norm": 1e-3, "frobenius_norm": 1e-3, "stable_rank": 2e-3,
             "nuclear_norm": 0.1, "sigma1_ratio": 0.1, "effective_rank": 0.3}


class FakeCupy:
    """The part of CuPy (and cupyx.errstate) that solvers.eigensolver_via uses, over NumPy on the CPU.
    Its solvers insist on being called under errstate(linalg="raise"): CuPy's default ignores a
    batched solver's failures (a matrix that did not converge comes back as garbage)."""

    raising = False

    @staticmethod
    @contextmanager
    def errstate(linalg: str | None = None):
        before, FakeCupy.raising = FakeCupy.raising, linalg == "raise"
        try:
            yield
        finally:
            FakeCupy.raising = before

    class linalg:
        @staticmethod
        def eigh(x):
            assert FakeCupy.raising, "CuPy's solver called without errstate(linalg='raise')"
            return np.linalg.eigh(x)

        @staticmethod
        def eigvalsh(x):
            assert FakeCupy.raising, "CuPy's solver called without errstate(linalg='raise')"
            return np.linalg.eigvalsh(x)

    from_dlpack = staticmethod(np.from_dlpack)
    cuda = SimpleNamespace(Device=lambda index: nullcontext(), ExternalStream=lambda pointer: nullcontext())


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory, tokenizer):
    """A tiny random Qwen3-MoE (2 layers, 4 experts, top-2) with SmolLM2's tokenizer, saved like any local model."""
    return _saved(tmp_path_factory, tokenizer, "qwen3_moe")


@pytest.fixture(scope="module")
def single_thread():
    """one_thread for a whole module (pytestmark = pytest.mark.usefixtures("single_thread")): retrains
    compared to the last bit (a CLI run against a direct one) must run on as many threads."""
    with one_thread():
        yield
