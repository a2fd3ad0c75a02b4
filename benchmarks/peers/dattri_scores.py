"""dattri 0.3.0's TracIn, TRAK and LoGra scores of a pool against a target, as an attribution file `gradspec
validate` reads, with the wall time and peak memory beside it.

Run with the interpreter of the venv made by benchmarks/peers/dattri_env.sh (dattri is not a dependency of
gradspec and is never imported by it), PYTHONPATH at the checkout (gradspec's pure-Python reader, template
and loss):

    benchmarks/peers/dattri_env.sh OUT                           # once: OUT/.venv-dattri
    PYTHONPATH=. OUT/.venv-dattri/bin/python benchmarks/peers/dattri_scores.py --method tracin|trak|logra \\
        --model DIR --pool pool.jsonl --target target.jsonl --out attribution.parquet --max-length 256 \\
        [--modules q_proj,k_proj,v_proj,o_proj] [--proj-dim N] [--proj-type normal|rademacher|random_mask|identity] \\
        [--regularization R] [--damping D] [--batch-size 1]

The loss, on both sides: gradspec's, the mean next-token cross-entropy over each row's response tokens
(gradspec.engine.loss.response_loss_per_sample), the rows read by gradspec's reader and `plain` template and
cut to their first --max-length tokens; a row gradspec would not score gets no attribution (null). Only the
weights of the linear modules whose name ends in one of --modules (default q/k/v/o) are attributed. One
model, no training checkpoints: TracIn is the single-checkpoint Grad-Dot (weight 1).

- tracin: dattri.algorithm.TracInAttributor(weight_list=[1], normalized_grad=False): per-sample gradients
  by torch.func (vmap over grad of a functional_call), each randomly projected to --proj-dim (dattri's
  TracIn always projects: its projector_kwargs default to 512 dims and cannot be turned off), then
  <P g_pool, P g_target>. Positive: the gradients agree, so a step on the pool row lowers the target's loss.
- trak: dattri.algorithm.TRAKAttributor: the pool's projected loss gradients Phi (scaled by 1/sqrt(the
  model's parameter count)), score = P g_target (Phi^T Phi + R I)^-1 Phi^T diag(Q) with Q = 1 - p, p =
  exp(-row loss) (dattri's "correct probability" for a language model). The target side is the loss's
  gradient too, so positive is helpful, as for TracIn. Phi^T Phi is proj_dim x proj_dim from the pool's
  rows: singular where the pool has fewer rows than --proj-dim, so with R = 0 (dattri's default) the
  script refuses --proj-dim above the scored rows.
- logra: dattri.algorithm.LoGraAttributor (block-projected influence: each module's gradient projected by a
  Kronecker product of two sqrt(--proj-dim) Gaussian projections, built from forward/backward hooks), with
  its eFIM Hessian (the projected per-sample gradients' second moments, damped by --damping x the mean
  eigenvalue; None: dattri's 1e-5) and score = g_pool^T H^-1 g_target: positive is helpful. Its target
  gradients come from the model's own `outputs.loss` (dattri's code), which for one row per batch is the
  same mean response NLL; the script therefore runs LoGra one row per batch and checks the two losses agree.

What runs on the CPU (2026-12-08, SmolLM2-135M-Instruct, q/k/v/o, 8 HumanEval pool rows x 2 targets,
max_length 128, 2 shared cores of an AMD EPYC; benchmarks/RESULTS.md):
- logra runs: 335 s, peak RSS 2.0 GiB at --proj-dim 256 (dattri's default 4096 would hold a 4096 x 4096
  fp32 Hessian per module, 7.5 GiB for the 120 modules).
- tracin and trak install and start but do not finish in a useful time: their per-sample gradients come from
  torch.func (vmap of grad), and dattri's layer selection (partial_param) still differentiates the model's
  whole flattened parameter vector (134.5M values, 538 MB a row in fp32): at --batch-size 4 the backward
  asked for 2152240128 bytes at once (`DefaultCPUAllocator: can't allocate memory`, under a 10 GB address-
  space limit; without it, and --proj-type normal --proj-dim 32, the kernel killed the run at 12.3 GiB of
  RSS); at --batch-size 1 (the default here) one target's gradient took 390 s and after 15.7 minutes TracIn
  had two of its 8 + 16 gradients (it recomputes the target gradients for every pool batch; peak RSS 6.8
  GiB, two thirds of the CPU time spent in the kernel faulting pages in): about 2.5 hours for this smoke, so
  it was stopped. TRAK takes the same path (8 + 2 gradients). They are wired up and run as written; give
  them a GPU or a smaller model.
- The projections on the CPU (dattri.func.projection.BasicProjector): `normal`/`rademacher` materialise a
  feature_dim x min(proj_dim, 100) fp32 matrix per block, feature_dim being all the attributed weights
  (q/k/v/o of SmolLM2-135M: 26.5M, so 10.6 GB a block at proj_dim >= 100), and dattri builds one for every
  batch, keeping its last train and target projectors while it builds the next (three at once). The script
  refuses more than --max-projector-gib (default 4) of them before starting, naming the size: use
  `random_mask` (dattri's sampled coordinates, no matrix), a smaller --proj-dim, or fewer modules. dattri's
  CUDA projectors (sjlt, fast_jl) do not run on the CPU.
- dattri replaces a NaN gradient by 0 (torch.nan_to_num) in TracIn and TRAK: a row whose gradient is not
  finite gets a score of 0, not an error.

Output: the attribution file (peer_files.attribution_frame) and OUT.json beside it: tool, version, method,
seconds (wall, the whole run), peak_rss_mib, modules, max_length, rows, targets and the settings.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # gradspec and benchmarks: pure-Python parts only

from benchmarks.peers.peer_files import ListDataset, Run, attribution_frame, read_inputs  # noqa: E402

METHODS = ("tracin", "trak", "logra")
PROJECTIONS = ("normal", "rademacher", "random_mask", "identity")
MODULES = "q_proj,k_proj,v_proj,o_proj"
DEFAULT_PROJ_DIM = {"tracin": 512, "trak": 512, "logra": 4096}  # dattri's defaults


def linear_names(model, suffixes: str) -> list[str]:
    """The names of model's nn.Linear modules whose last name part is one of the comma-separated suffixes."""
    from torch import nn

    wanted = [s.strip() for s in suffixes.split(",") if s.strip()]
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in wanted]
    missing = [s for s in wanted if s not in {n.rsplit(".", 1)[-1] for n in names}]
    if missing or not names:
        raise SystemExit(f"--modules: no linear module named {', '.join(missing) or suffixes} in the model")
    return names


def projector_bytes(feature_dim: int, proj_dim: int, proj_type: str) -> int:
    """The dense matrices dattri's CPU projectors hold at once (0 for the kinds that hold none): one block,
    feature_dim x min(proj_dim, 100) fp32, per projector, and TracIn holds three (it keeps its last train
    and test projectors while it builds the next: dattri/algorithm/tracin.py)."""
    return 3 * feature_dim * min(proj_dim, 100) * 4 if proj_type in ("normal", "rademacher") else 0


def loader(items, batch_size: int, pad_id: int, as_dict: bool):
    """A DataLoader over tokenized rows, in order: (ids, labels) right-padded (causal attention: a real
    position never sees the padding after it, so the functional path needs no mask, which vmap cannot
    take in transformers' mask code), or LoGra's dict with the attention mask and labels."""
    import torch

    from gradspec.data.batching import pad_batch

    def collate(batch):
        ids, mask, labels = pad_batch(batch, pad_id, "cpu")
        if as_dict:
            return {"input_ids": ids, "attention_mask": mask, "labels": labels}
        return ids, labels

    return torch.utils.data.DataLoader(ListDataset(items), batch_size=batch_size, shuffle=False, collate_fn=collate)


def main(argv: list[str] | None = None) -> dict:
    """Run as the module docstring says; returns the sidecar's fields."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", choices=METHODS, required=True)
    ap.add_argument("--model", required=True, help="a Hugging Face model folder")
    ap.add_argument("--pool", required=True, type=Path)
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path, help="the attribution file (.parquet); OUT.json beside it")
    ap.add_argument("--max-length", required=True, type=int, help="each row's first tokens (gradspec's)")
    ap.add_argument("--modules", default=MODULES, help=f"linear modules by last name part (default {MODULES})")
    ap.add_argument("--proj-dim", type=int, help="projected dimensions (dattri's default: 512; LoGra 4096)")
    ap.add_argument("--proj-type", choices=PROJECTIONS, default="normal", help="TracIn/TRAK's CPU projector")
    ap.add_argument("--max-projector-gib", type=float, default=4.0, help="refuse a larger dense projector")
    ap.add_argument("--regularization", type=float, default=0.0, help="TRAK: added to Phi^T Phi's diagonal")
    ap.add_argument("--damping", type=float, help="LoGra: x the mean eigenvalue (default: dattri's 1e-5)")
    ap.add_argument("--batch-size", type=int, default=1,
                    help="rows per vmap batch (TracIn, TRAK: each row's gradient is the whole model's; LoGra: 1)")
    ap.add_argument("--seed", type=int, default=0, help="the projections' seed")
    args = ap.parse_args(argv)
    proj_dim = args.proj_dim or DEFAULT_PROJ_DIM[args.method]

    run = Run("dattri", importlib.metadata.version("dattri"), args.method)
    import torch
    from dattri.task import AttributionTask
    from torch.func import functional_call

    from gradspec.data.batching import pad_id_of
    from gradspec.engine.loss import response_loss_per_sample

    tokenizer, pool, target, model = read_inputs(args)
    modules = linear_names(model, args.modules)
    weights = [f"{m}.weight" for m in modules]
    feature_dim = sum(model.get_parameter(w).numel() for w in weights)
    pad_id = pad_id_of(tokenizer)
    train_items = [pool.tokens[i] for i in pool.scored]
    settings: dict = {"proj_dim": proj_dim, "feature_dim": feature_dim}

    if args.method in ("tracin", "trak"):
        need = projector_bytes(feature_dim, proj_dim, args.proj_type)
        if need > args.max_projector_gib * 2**30:
            raise SystemExit(f"--proj-type {args.proj_type}: dattri's CPU projectors would hold three {feature_dim} x "
                             f"{min(proj_dim, 100)} fp32 matrices ({need / 2**30:.1f} GiB, over --max-projector-gib "
                             f"{args.max_projector_gib:g}); use --proj-type random_mask, a smaller --proj-dim or "
                             "fewer --modules")
        if args.method == "trak" and args.regularization == 0 and proj_dim > len(train_items):
            raise SystemExit(f"--proj-dim {proj_dim}: TRAK's kernel (proj_dim x proj_dim, from the pool's "
                             f"{len(train_items)} rows) is singular; pass --proj-dim <= {len(train_items)} or "
                             "--regularization > 0")

        def loss_func(params, data):
            ids, labels = data
            logits = functional_call(model, params, (ids[None],), {"use_cache": False}).logits
            return response_loss_per_sample(logits, labels[None])[0][0]

        task = AttributionTask(loss_func=loss_func, model=model, checkpoints=model.state_dict())
        projector = {"proj_dim": proj_dim, "proj_max_batch_size": 32, "proj_seed": args.seed, "device": "cpu",
                     "proj_type": args.proj_type}
        settings |= {"proj_type": args.proj_type, "batch_size": args.batch_size}
        train = loader(train_items, args.batch_size, pad_id, False)
        test = loader(target.tokens, args.batch_size, pad_id, False)
        if args.method == "tracin":
            from dattri.algorithm.tracin import TracInAttributor

            attributor = TracInAttributor(task=task, weight_list=torch.tensor([1.0]), normalized_grad=False,
                                          projector_kwargs=projector, layer_name=weights, device="cpu")
            scores = attributor.attribute(train, test)
        else:
            from dattri.algorithm.trak import TRAKAttributor

            def correct_probability(params, data):
                return torch.exp(-loss_func(params, data))

            attributor = TRAKAttributor(task=task, correct_probability_func=correct_probability,
                                        projector_kwargs=projector, layer_name=weights, device="cpu",
                                        regularization=args.regularization)
            attributor.cache(train)
            scores = attributor.attribute(test)
            settings["regularization"] = args.regularization
    else:
        from dattri.algorithm.logra import LoGraAttributor

        if math.isqrt(proj_dim) ** 2 != proj_dim:
            raise SystemExit(f"--proj-dim {proj_dim}: LoGra's must be a square (two factors of sqrt(proj_dim))")

        def loss_func(model_, batch, device):
            logits = model_(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                            use_cache=False).logits
            return response_loss_per_sample(logits, batch["labels"].to(device))[0].sum()

        check = next(iter(loader(target.tokens[:1], 1, pad_id, True)))
        with torch.no_grad():
            ours, theirs = float(loss_func(model, check, "cpu")), float(model(**check).loss)
        if not math.isclose(ours, theirs, rel_tol=1e-5):
            raise SystemExit(f"LoGra's target loss (the model's own, {theirs}) is not gradspec's ({ours})")
        task = AttributionTask(loss_func=loss_func, model=model, checkpoints=model.state_dict())
        attributor = LoGraAttributor(task=task, layer_names=modules, hessian="eFIM", damping=args.damping,
                                     device="cpu", proj_dim=proj_dim, offload="cpu")
        attributor.cache(loader(train_items, 1, pad_id, True))
        scores = attributor.attribute(loader(train_items, 1, pad_id, True), loader(target.tokens, 1, pad_id, True))
        settings |= {"damping": args.damping, "batch_size": 1, "hessian": "eFIM"}

    scores = scores.detach().double().numpy().T  # dattri: (train, test) -> (targets, scored pool rows)
    frame = attribution_frame(scores, pool.scored, len(pool.tokens), f"dattri {args.method}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = run.write(args.out, frame, modules=args.modules, max_length=args.max_length, rows=len(pool.tokens),
                       targets=len(target.tokens), scored_rows=len(pool.scored), **settings, model=str(args.model),
                       torch=torch.__version__, threads=torch.get_num_threads())
    print(f"{len(pool.scored)} pool x {len(target.tokens)} target scores -> {args.out} "
          f"({record['seconds']:.1f} s, peak RSS {record['peak_rss_mib']:.0f} MiB)")
    return record


if __name__ == "__main__":
    main()
