"""gradspec against what a user would write instead, on the same model, samples, loss and parts (issue 40, item 5).

Every row computes, for each sample, the singular values of each scored part's per-sample weight gradient
and from them the nuclear and spectral norms; the loss is each sample's mean next-token cross-entropy over
its response tokens (``gradspec.engine.loss``: the engine's ``response_losses`` for gradspec, the same loss
from the full logits, ``response_loss_per_sample``, for the others). Rows:

- gradspec: ``SpectralEngine(model, parts).score`` on the padded batch (one forward, one input-gradient
  backward, exact spectra from the captured inputs and output gradients; fp64 Grams and eigenproblems);
- vmap(grad), batch 1: ``torch.func.vmap(torch.func.grad(loss))`` over a batch of one unpadded sample at a
  time, the scored weights passed through ``functional_call``; then that sample's gradients, stacked by
  shape, through ``torch.linalg.svdvals`` in fp32;
- vmap(grad), batched: the same over all samples at once, right-padded, each sample's loss masked by its
  labels. No attention mask: transformers' mask construction is data-dependent and fails under vmap
  (``RuntimeError: vmap: It looks like you're either (1) calling .item() ...``); with right padding and
  causal attention the padding cannot reach a sample's real tokens, so the gradients are the same
  (the agreement column checks it). Then one fp32 svdvals per shape over all samples;
- Opacus: Opacus 1.6's ``GradSampleModule(model, batch_first=True, loss_reduction="sum")`` on the padded
  batch with its attention mask, the scored weights the only trainable parameters, the model in train mode
  (Opacus captures activations only in training mode; these models have no dropout), then ``p.grad_sample``
  through fp32 svdvals as above. Opacus is no dependency of gradspec: this row runs in a subprocess of the
  venv ``benchmarks/peers/peers_env.sh`` makes (default /tmp/gradspec-peers-env; GRADSPEC_PEERS_ENV moves it),
  with PYTHONPATH at this checkout. Without that venv the row is skipped and says so;
- the paper's procedure: ``gradspec.engine.reference.reference_scores``, one unpadded sample at a time,
  ``loss.backward()`` for real parameter gradients (fp32), and all singular values of every gradient
  matrix (``torch.linalg.svdvals`` in fp64 of the fp32 gradient).

Agreement: each row's nuclear and spectral norms per (sample, part) against an fp64 reference (the paper's
procedure on a float64 copy of the model: fp64 gradients, fp64 SVD), max relative error over every pair
whose reference is nonzero. For the peers, the same gradients through fp64 svdvals are reported too, with
the SVD stage's seconds in both precisions (measured once, after the rounds).

Timing: every row lives in its own worker process (this file run with ``--worker``), built once and warmed
up once; ROUNDS interleaved rounds (``common.interleaved_rounds``: each round runs every row once, back to
back, starting at another row) send each worker "run" and wait for it, so only one row computes at a time.
Per-sample seconds: the median round over the number of samples, and the fastest round (on a shared machine
the least disturbed). Peak RSS is each worker's own VmHWM (its interpreter, torch, the model, and the row's
peak over the warm-up and the rounds), after setup and after all rounds.

Cases: a random-init Llama of SmolLM2-135M's shape, 4 of its 30 layers (hidden 576, 9 heads, 3 KV heads
of 64, MLP 1,536, vocabulary 49,152, tied head; q/k/v/o of every layer: 16 parts) on 8 samples of 64-256
tokens, the second half the response; and bench_moe's random-init Qwen3-MoE shape (hidden 256, 64 experts
top-4, expert width 96), here with 2 layers and 4 samples of 96-256 tokens, every part gradspec's "all"
scores (q/k/v/o, each expert's gate/up/down, the router: 394 parts). There the paper's procedure slices the
fused 3-D experts' .grad, and the vmap rows slice their per-sample fused gradients (N, experts, d_out, d_in)
the same way (``Part.slice``): under transformers' default experts implementation (grouped_mm) vmap runs
(``_grouped_mm`` through vmap's per-sample fallback); under "eager" it fails, and Opacus fails on the
experts and on the router: the MoE case tries each once and prints what happens; Opacus has no MoE row.

Run with ``pytest benchmarks/peers/bench_peers.py -s`` (about 5 minutes on 2 cores); make the Opacus venv first
with ``benchmarks/peers/peers_env.sh``. Ratios only within one run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import REPO, interleaved_rounds, peak_rss_mib

ROUNDS = int(os.environ.get("BENCH_ROUNDS", 3))
ROOT = REPO
PEERS_ENV = Path(os.environ.get("GRADSPEC_PEERS_ENV", "/tmp/gradspec-peers-env"))
OPACUS_PYTHON = PEERS_ENV / ".venv-opacus" / "bin" / "python"
CASES = {"dense": [64, 96, 128, 160, 192, 208, 224, 256], "moe": [96, 144, 192, 256]}
VOCAB = {"dense": 49152, "moe": 4096}
SAMPLE_ROWS = {"dense": ["gradspec", "vmap(grad), batch 1", "vmap(grad), batched", "Opacus", "paper's procedure"],
               "moe": ["gradspec", "vmap(grad), batch 1", "vmap(grad), batched", "paper's procedure"]}
PRECISION = {
    "gradspec": "fp32 model; fp64 Grams and eigenproblems",
    "vmap(grad), batch 1": "fp32 gradients, fp32 svdvals",
    "vmap(grad), batched": "fp32 gradients, fp32 svdvals",
    "Opacus": "fp32 grad_sample, fp32 svdvals",
    "paper's procedure": "fp32 .grad, fp64 svdvals",
}


# ---- the model, samples and parts: the same in every process --------------------------------------------------

def model_for(case: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if case == "dense":
        from transformers import LlamaConfig, LlamaForCausalLM

        # SmolLM2-135M's shape (its config.json), 4 of its 30 layers
        config = LlamaConfig(vocab_size=VOCAB["dense"], hidden_size=576, num_hidden_layers=4, num_attention_heads=9,
                             num_key_value_heads=3, head_dim=64, intermediate_size=1536, tie_word_embeddings=True,
                             rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192, pad_token_id=0)
        return LlamaForCausalLM(config).eval().requires_grad_(False)
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # bench_moe.moe_model's shape, 2 layers instead of 4
    config = Qwen3MoeConfig(vocab_size=VOCAB["moe"], hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=96,
                            num_experts=64, num_experts_per_tok=4, norm_topk_prob=True)
    return Qwen3MoeForCausalLM(config).eval().requires_grad_(False)


def modules_for(case: str) -> str:
    return "attn" if case == "dense" else "all"


def samples_for(case: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) per sample, unpadded: random tokens, the second half the response."""
    from gradspec.data.templates import IGNORE_INDEX

    g = torch.Generator().manual_seed(0)
    out = []
    for n in CASES[case]:
        ids = torch.randint(3, VOCAB[case], (n,), generator=g)
        labels = torch.full((n,), IGNORE_INDEX)
        labels[n // 2:] = ids[n // 2:]
        out.append((ids, labels))
    return out


def padded(samples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from gradspec.data.batching import pad_batch
    from gradspec.data.templates import Tokenized

    return pad_batch([Tokenized(ids.tolist(), labels.tolist(), "ok") for ids, labels in samples], 0, "cpu")


def norms(sigmas: list[dict[str, torch.Tensor]]) -> dict[str, list[dict[str, float]]]:
    """Per sample {part: value} of the nuclear and the spectral norm, from singular values."""
    return {"nuclear": [{p: float(s.double().sum()) for p, s in d.items()} for d in sigmas],
            "spectral": [{p: float(s.double().max()) if s.numel() else 0.0 for p, s in d.items()} for d in sigmas]}


def batched_svdvals(grads: dict[tuple[int, str], torch.Tensor],
                    dtype=torch.float32) -> dict[tuple[int, str], torch.Tensor]:
    """{(sample, part): gradient (d_out, d_in)} -> {(sample, part): singular values}, one svdvals per shape
    (each matrix taken tall: the same values, a faster LAPACK call)."""
    by_shape: dict[tuple[int, ...], list[tuple[int, str]]] = {}
    for key, g in grads.items():
        by_shape.setdefault(tuple(g.shape), []).append(key)
    out = {}
    for shape, keys in by_shape.items():
        stack = torch.stack([grads[k] for k in keys]).to(dtype)
        sigma = torch.linalg.svdvals(stack.mT if shape[0] < shape[1] else stack)
        out.update(zip(keys, sigma, strict=True))
    return out


def per_sample(sigma: dict[tuple[int, str], torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    for (i, part), s in sigma.items():
        out[i][part] = s
    return out


# ---- the rows, as each worker builds them ---------------------------------------------------------------------

class Row:
    """run() -> per-sample singular values of every part; grads() -> the last run's gradients (peers only)."""

    last_grads: dict[tuple[int, str], torch.Tensor] | None = None


def part_slicers(model, case: str):
    """[(part name, parameter name, slice function)] of the scored parts, as gradspec's registry defines them;
    the Opacus venv has no gradspec extension, so for the dense case plain weights by name."""
    if case == "dense":
        return [(n.removesuffix(".weight"), n, lambda g: g) for n, _ in model.named_parameters()
                if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))]
    from gradspec.layers.targets import select_targets

    return [(p.name, p.parameter, p.slice) for t in select_targets(model, modules_for(case)) for p in t.parts]


class Gradspec(Row):
    def __init__(self, model, case, samples):
        from gradspec.engine.spectral_engine import SpectralEngine

        self.engine = SpectralEngine(model, modules_for(case), keep_spectra=True)
        self.batch = padded(samples)

    def run(self):
        scores = self.engine.score(*self.batch)
        n = len(scores.loss)
        return [{p: torch.from_numpy(scores.spectra[p][i]) for p in scores.spectra} for i in range(n)]


class VmapGrad(Row):
    def __init__(self, model, case, samples, batched: bool):
        from torch.func import functional_call, grad, vmap

        from gradspec.engine.loss import response_loss_per_sample

        self.slicers = part_slicers(model, case)
        names = dict.fromkeys(p for _, p, _ in self.slicers)
        self.params = {n: p for n, p in model.named_parameters() if n in names}

        def loss(params, ids, labels):
            logits = functional_call(model, params, (ids[None],), {"use_cache": False}).logits
            return response_loss_per_sample(logits, labels[None])[0].sum()

        self.grad_fn = vmap(grad(loss), in_dims=(None, 0, 0))
        self.samples, self.batched = samples, batched
        if batched:
            ids, _, labels = padded(samples)
            self.batch = (ids, labels)  # no attention mask: see the module's docstring

    def grads_of(self, out, rows) -> dict[tuple[int, str], torch.Tensor]:
        return {(i, name): cut(out[param][k]) for k, i in enumerate(rows) for name, param, cut in self.slicers}

    def run(self):
        n = len(self.samples)
        if self.batched:
            grads = self.grads_of(self.grad_fn(self.params, *self.batch), range(n))
            self.last_grads = grads
            return per_sample(batched_svdvals(grads), n)
        sigma, self.last_grads = {}, {}
        for i, (ids, labels) in enumerate(self.samples):
            grads = self.grads_of(self.grad_fn(self.params, ids[None], labels[None]), [i])
            sigma.update(batched_svdvals(grads))  # this sample's parts, stacked by shape
            self.last_grads.update(grads)
        return per_sample(sigma, n)


class Opacus(Row):
    def __init__(self, model, case, samples):
        from opacus import GradSampleModule

        from gradspec.engine.loss import response_loss_per_sample

        self.slicers = part_slicers(model, case)
        names = {p for _, p, _ in self.slicers}
        self.params = {n: p for n, p in model.named_parameters() if n in names}
        for p in self.params.values():
            p.requires_grad_(True)
        self.gsm = GradSampleModule(model.train(), batch_first=True, loss_reduction="sum")
        self.loss = response_loss_per_sample
        self.batch = padded(samples)
        self.n = len(samples)

    def run(self):
        ids, mask, labels = self.batch
        self.gsm.zero_grad(set_to_none=True)  # also clears grad_sample, which would accumulate
        logits = self.gsm(input_ids=ids, attention_mask=mask, use_cache=False).logits
        self.loss(logits, labels)[0].sum().backward()
        grads = {(i, name): cut(self.params[param].grad_sample[i]) for i in range(self.n)
                 for name, param, cut in self.slicers}
        self.last_grads = grads
        return per_sample(batched_svdvals(grads), self.n)


class Paper(Row):
    def __init__(self, model, case, samples):
        self.model, self.modules, self.samples = model, modules_for(case), samples

    def run(self):
        from gradspec.engine.reference import reference_scores

        return [reference_scores(self.model, ids, labels, self.modules)[2] for ids, labels in self.samples]


def build_row(row: str, case: str):
    model, samples = model_for(case), samples_for(case)
    if row == "gradspec":
        return Gradspec(model, case, samples)
    if row.startswith("vmap"):
        return VmapGrad(model, case, samples, batched=row.endswith("batched"))
    if row == "Opacus":
        return Opacus(model, case, samples)
    if row == "paper's procedure":
        return Paper(model, case, samples)
    raise ValueError(row)


def worker(row: str, case: str) -> None:
    """Commands on stdin, one JSON line per answer on the original stdout (anything else printed goes to
    stderr): "run" -> seconds; "result" -> the last run's norms, the fp64-SVD norms and SVD seconds of a
    peer's last gradients, peak RSS after setup and now."""
    import warnings

    # printed once per process otherwise: vmap's fallback for ops without a batching rule (the SDPA backward on
    # the CPU, grouped_mm), and Opacus's full backward hooks on modules whose inputs need no gradient
    warnings.filterwarnings("ignore", "There is a performance drop")
    warnings.filterwarnings("ignore", "Full backward hook is firing")
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    torch.manual_seed(0)
    try:
        r = build_row(row, case)
    except Exception as e:  # the row cannot run here: say why, and stop
        out.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        return
    setup_rss = peak_rss_mib()
    out.write(json.dumps({"ready": setup_rss}) + "\n")
    last = None
    for line in sys.stdin:
        command = line.strip()
        if command == "run":
            start = time.perf_counter()
            last = r.run()
            out.write(json.dumps({"seconds": time.perf_counter() - start}) + "\n")
        elif command == "result":
            answer = {"norms": norms(last), "setup_rss": setup_rss, "peak_rss": peak_rss_mib()}
            if r.last_grads is not None:
                n = len(last)
                for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64)):
                    start = time.perf_counter()
                    sigma = batched_svdvals(r.last_grads, dtype)
                    answer[f"svd_seconds_{name}"] = time.perf_counter() - start
                    answer[f"norms_{name}"] = norms(per_sample(sigma, n))
            out.write(json.dumps(answer) + "\n")
        else:
            return


# ---- what does not run: the peers on the MoE's fused experts --------------------------------------------------

def moe_probe(peer: str) -> None:
    """Try a peer on the MoE's fused experts (and Opacus on its router alone); print what happens."""
    from gradspec.engine.loss import response_loss_per_sample

    model = model_for("moe")
    ids, _, labels = padded(samples_for("moe")[:2])
    ids, labels = ids[:, :96], labels[:, :96]
    fused = {n: p for n, p in model.named_parameters() if ".mlp." in n}
    if peer == "vmap":
        from torch.func import functional_call, grad, vmap

        def loss(params, i, lab):
            logits = functional_call(model, params, (i[None],), {"use_cache": False}).logits
            return response_loss_per_sample(logits, lab[None])[0].sum()

        for implementation in ("grouped_mm", "eager"):
            model.set_experts_implementation(implementation)
            try:
                g = vmap(grad(loss), in_dims=(None, 0, 0))(fused, ids, labels)
                shapes = sorted({tuple(v.shape) for v in g.values()})
                print(f"vmap(grad), experts '{implementation}': runs; per-sample gradients of shapes {shapes}")
            except Exception as e:
                print(f"vmap(grad), experts '{implementation}': {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        return
    from opacus import GradSampleModule

    for what, wanted in (("experts and router", lambda n: ".mlp." in n), ("router alone", lambda n: ".mlp.gate." in n)):
        model = model_for("moe")
        for n, p in model.named_parameters():
            p.requires_grad_(wanted(n))
        stage = "wrapping"
        try:
            gsm = GradSampleModule(model.train(), batch_first=True, loss_reduction="sum")
            stage = "forward"
            loss = response_loss_per_sample(gsm(input_ids=ids, use_cache=False).logits, labels)[0].sum()
            stage = "backward"
            loss.backward()
            shapes = {n: tuple(p.grad_sample.shape) if getattr(p, "grad_sample", None) is not None else None
                      for n, p in model.named_parameters() if wanted(n) and "layers.0." in n}
            print(f"Opacus, {what} trainable, batch of {len(ids)} x {ids.shape[1]} tokens: runs; "
                  f"layer 0's grad_sample shapes {shapes}")
        except Exception as e:
            print(f"Opacus, {what} trainable: {type(e).__name__} in the {stage}: {str(e).splitlines()[0][:200]}")


# ---- the parent: pytest ---------------------------------------------------------------------------------------

class Worker:
    def __init__(self, row: str, case: str):
        python = str(OPACUS_PYTHON) if row == "Opacus" else sys.executable
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([python, __file__, "--worker", row, case], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.ready = self.ask(None)

    def ask(self, command: str | None) -> dict:
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker ended (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()


def reference_norms(case: str) -> dict[str, list[dict[str, float]]]:
    """fp64 throughout: the paper's procedure on a float64 copy of the model (eager experts: grouped_mm has no
    fp64 CPU kernel to rely on)."""
    from gradspec.engine.reference import reference_scores

    model = model_for(case).double()
    if case == "moe":
        model.set_experts_implementation("eager")
    return norms([reference_scores(model, ids, labels, modules_for(case))[2] for ids, labels in samples_for(case)])


def max_rel_error(got: dict, ref: dict) -> dict[str, float]:
    """Max relative error per norm over (sample, part) pairs with a nonzero reference (NaN where a row gives
    no value for such a pair, e.g. gradspec on an expert the sample never reached: its reference is 0)."""
    out = {}
    for norm in ("nuclear", "spectral"):
        errors = []
        for g, r in zip(got[norm], ref[norm], strict=True):
            for part, value in r.items():
                if value > 0:
                    errors.append(abs(g.get(part, float("nan")) - value) / value)
        out[norm] = max(errors) if errors else float("nan")
    return out


def run_case(case: str) -> None:

    n = len(CASES[case])
    workers, skipped = {}, {}
    for row in SAMPLE_ROWS[case]:
        if row == "Opacus" and not OPACUS_PYTHON.exists():
            skipped[row] = f"no Opacus venv at {PEERS_ENV} (make it with benchmarks/peers/peers_env.sh)"
            continue
        w = Worker(row, case)
        if "error" in w.ready:
            skipped[row] = w.ready["error"]
            w.close()
            continue
        workers[row] = w
    try:
        for w in workers.values():
            w.ask("run")  # warm-up, not timed
        times = interleaved_rounds({row: (lambda w=w: w.ask("run")) for row, w in workers.items()}, ROUNDS,
                                   f"{case}, ")
        results = {row: w.ask("result") for row, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()
    ref = reference_norms(case)
    per = {row: statistics.median(t) / n for row, t in times.items()}
    best = {row: min(t) / n for row, t in times.items()}
    parts = len(ref["nuclear"][0])
    print(f"\n{case}: {n} samples of {min(CASES[case])}-{max(CASES[case])} tokens, {parts} parts "
          f"({modules_for(case)}); median of {ROUNDS} interleaved rounds; agreement = max relative error "
          "against the fp64 reference")
    print(f"  {'row':22s} {'s/sample':>9s} {'x gradspec':>10s} {'best':>7s} {'x':>6s} {'peak RSS':>9s} {'(setup)':>8s} "
          f"{'nuclear':>9s} {'spectral':>9s}  precision")
    for row in workers:
        res, err = results[row], max_rel_error(results[row]["norms"], ref)
        print(f"  {row:22s} {per[row]:9.3f} {per[row] / per['gradspec']:10.2f} {best[row]:7.3f} "
              f"{best[row] / best['gradspec']:6.2f} {res['peak_rss']:7.0f} M "
              f"{res['setup_rss']:6.0f} M {err['nuclear']:9.1e} {err['spectral']:9.1e}  {PRECISION[row]}")
    for row in skipped:
        print(f"  {row:22s} skipped: {skipped[row]}")
    print("  the peers' SVD stage alone, on their last gradients (s per sample, fp32 -> fp64; agreement with fp64 "
          "svdvals of the same fp32 gradients):")
    for row, res in results.items():
        if "svd_seconds_fp32" in res:
            err = max_rel_error(res["norms_fp64"], ref)
            print(f"    {row:22s} {res['svd_seconds_fp32'] / n:.4f} -> {res['svd_seconds_fp64'] / n:.4f} s; "
                  f"nuclear {err['nuclear']:.1e}, spectral {err['spectral']:.1e}")
    print("  rounds (s): " + "; ".join(f"{row} {', '.join(f'{t:.2f}' for t in ts)}" for row, ts in times.items()))


def test_dense():
    run_case("dense")


def test_moe():
    run_case("moe")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    print("\nthe peers on the MoE's fused 3-D experts (2 samples, 96 tokens):")
    probes = [("vmap", sys.executable)] + ([("opacus", str(OPACUS_PYTHON))] if OPACUS_PYTHON.exists() else [])
    for peer, python in probes:
        done = subprocess.run([python, __file__, "--probe", peer], env=env, cwd=ROOT, capture_output=True, text=True)
        print("  " + "\n  ".join(done.stdout.strip().splitlines() or [f"{peer}: exit {done.returncode}: "
                                                                       f"{done.stderr.strip().splitlines()[-1:]}"]))
    if not OPACUS_PYTHON.exists():
        print(f"  Opacus: skipped, no venv at {PEERS_ENV}")


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "--probe":
        import warnings

        warnings.simplefilter("ignore")
        moe_probe(sys.argv[2])
