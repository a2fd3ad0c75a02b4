"""kronfluence 1.0.1's influence scores of a pool against a target, as an attribution file `gradspec validate`
reads, with its wall time and peak memory beside it.

Run with the interpreter of the venv made by benchmarks/peers/kronfluence_env.sh (kronfluence is not a
dependency of gradspec and is never imported by it), PYTHONPATH at the checkout (for gradspec's pure-Python
reader, template and loss):

    benchmarks/peers/kronfluence_env.sh OUT                      # once: OUT/.venv-kronfluence
    PYTHONPATH=. OUT/.venv-kronfluence/bin/python benchmarks/peers/kronfluence_scores.py \\
        --model DIR --pool pool.jsonl --target target.jsonl --out attribution.parquet --max-length 256 \\
        [--modules q_proj,k_proj,v_proj,o_proj] [--factors ekfac|kfac|diagonal|identity] \\
        [--damping heuristic|FLOAT] [--empirical-fisher] [--batch-size 4] [--workdir DIR]
    PYTHONPATH=. OUT/.venv-kronfluence/bin/python benchmarks/peers/kronfluence_scores.py --check-sign

What it computes: kronfluence's Task with gradspec's loss, the mean next-token cross-entropy over each
row's response tokens (gradspec.engine.loss.response_loss_per_sample; a batch's loss is the sum of its
rows' means, as kronfluence asks), both as the training loss and as the query's measurement. The rows are
read by gradspec's reader and `plain` template and cut to their first --max-length tokens
(gradspec.data.templates.tokenize); a row gradspec would not score gets no attribution (null). Only the
linear modules whose name ends in one of --modules are tracked (default q/k/v/o, gradspec align's).
kronfluence fits its factors on the pool (Analyzer.fit_all_factors, FactorArguments(strategy=--factors):
EK-FAC by default, with the true Fisher, labels sampled from the model at the response positions, as
kronfluence recommends; --empirical-fisher uses the rows' own labels, as gradspec's K-FAC does), then
Analyzer.compute_pairwise_scores(query=target, train=pool). --damping: kronfluence's damping_factor;
`heuristic` (the default here) is its None, 0.1 x the mean eigenvalue (the paper's, and relative like
gradspec's and bergson's 0.1); kronfluence's own default is 1e-8.

Sign: kronfluence's pairwise score is the dot product of the preconditioned measurement gradient of the
query with the training loss gradient, g_q^T H^-1 g_i (kronfluence/module/linear.py compute_pairwise_score;
no sign is flipped anywhere in kronfluence/score), so with the query's loss as the measurement a positive
score means a step on the row LOWERS the query's loss: gradspec's convention, written unchanged.
`--factors identity` gives gradspec align --attribution's own scores (the 8 x 2 smoke of 2026-12-08 agreed to
4 digits: the same rows, template, truncation, loss, modules and sign). --check-sign confirms the sign by
experiment (a least-squares model, identity factors, no damping: the score
against the change in the query's loss after one SGD step on each training row).

Output: the attribution file (peer_files.attribution_frame: `index`, `attribution` = one value per target
row in the target file's order) and OUT.json beside it: tool, version, method, seconds (wall, the whole
run: reading, model load, factors, scores), peak_rss_mib, modules, max_length, rows, targets and the
settings.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # gradspec and benchmarks: pure-Python parts only

from benchmarks.peers.peer_files import ListDataset, Run, attribution_frame, read_inputs  # noqa: E402

STRATEGIES = ("ekfac", "kfac", "diagonal", "identity")
MODULES = "q_proj,k_proj,v_proj,o_proj"


def tracked_modules(model, suffixes: str) -> list[str]:
    """The names of model's nn.Linear modules whose last name part is one of the comma-separated suffixes;
    an unknown suffix is an error naming it."""
    from torch import nn

    wanted = [s.strip() for s in suffixes.split(",") if s.strip()]
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in wanted]
    found = {n.rsplit(".", 1)[-1] for n in names}
    missing = [s for s in wanted if s not in found]
    if missing or not names:
        raise SystemExit(f"--modules: no linear module named {', '.join(missing) or suffixes} in the model")
    return names


def make_task(modules: list[str]):
    """kronfluence's Task with gradspec's loss (per-row mean response NLL, summed over the batch)."""
    import torch
    from kronfluence.task import Task

    from gradspec.data.templates import IGNORE_INDEX
    from gradspec.engine.loss import response_loss_per_sample

    class GradspecLoss(Task):
        def compute_train_loss(self, batch, model, sample: bool = False) -> torch.Tensor:
            ids, mask, labels = batch
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            if sample:  # the true Fisher: the response positions' labels drawn from the model
                with torch.no_grad():
                    probs = torch.softmax(logits[:, :-1].detach().float(), dim=-1)
                    drawn = torch.multinomial(probs.flatten(0, 1), 1).view(probs.shape[:2])
                    labels = labels.clone()
                    shifted = labels[:, 1:]
                    keep = shifted != IGNORE_INDEX
                    shifted[keep] = drawn[keep]
            return response_loss_per_sample(logits, labels)[0].sum()

        def compute_measurement(self, batch, model) -> torch.Tensor:
            return self.compute_train_loss(batch, model, sample=False)

        def get_influence_tracked_modules(self):
            return modules

        def get_attention_mask(self, batch):
            return batch[1]

    return GradspecLoss()


def collate(pad_id: int):
    from gradspec.data.batching import pad_batch

    return lambda items: pad_batch(items, pad_id, "cpu")


def check_sign() -> None:
    """kronfluence's sign, by experiment: on least squares with identity factors and no damping, the
    pairwise score of (query q, train row i) must have the sign of -(change in q's loss after one small SGD
    step on row i), i.e. positive where the step lowers q's loss."""
    import torch
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task
    from torch import nn

    torch.manual_seed(0)
    x, y = torch.randn(6, 3), torch.randn(6, 1)
    data = [(x[i], y[i]) for i in range(6)]

    class Squares(Task):
        def compute_train_loss(self, batch, model, sample=False):
            inputs, targets = batch
            out = model(inputs)
            if sample:
                targets = (out + torch.randn_like(out)).detach()
            return ((out - targets) ** 2).sum() / 2

        def compute_measurement(self, batch, model):
            return self.compute_train_loss(batch, model)

    model = nn.Sequential(nn.Linear(3, 1, bias=False))
    start = {k: v.clone() for k, v in model.state_dict().items()}

    def loss_of(i: int) -> float:
        with torch.no_grad():
            return float(((model(x[i:i + 1]) - y[i:i + 1]) ** 2).sum() / 2)

    expected = torch.zeros(2, 6)
    lr = 1e-3
    for i in range(6):
        for q in range(2):
            model.load_state_dict(start)
            before = loss_of(4 + q)
            model.zero_grad()
            ((model(x[i:i + 1]) - y[i:i + 1]) ** 2).sum().div(2).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= lr * p.grad
            expected[q, i] = -(loss_of(4 + q) - before) / lr
    model.load_state_dict(start)
    with tempfile.TemporaryDirectory() as work:
        task = Squares()
        analyzer = Analyzer("sign", prepare_model(model, task), task, cpu=True, disable_tqdm=True, output_dir=work)
        analyzer.fit_all_factors("f", data, per_device_batch_size=6,
                                 factor_args=FactorArguments(strategy="identity"))
        analyzer.compute_pairwise_scores("s", "f", query_dataset=data[4:], train_dataset=data,
                                         per_device_query_batch_size=2, per_device_train_batch_size=6,
                                         score_args=ScoreArguments(damping_factor=0.0))
        scores = analyzer.load_pairwise_scores("s")["all_modules"]
    agree = bool((torch.sign(scores) == torch.sign(expected)).all())
    close = float((scores - expected).abs().max() / expected.abs().max())
    print(f"kronfluence scores:\n{scores}\n-(change in the query loss) / lr after one SGD step:\n{expected}")
    print(f"signs agree: {agree}; largest difference {close:.2e} of the largest value")
    if not agree:
        raise SystemExit("kronfluence's sign is not gradspec's: the scores must be negated")


def main(argv: list[str] | None = None) -> dict:
    """Run as the module docstring says; returns the sidecar's fields."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check-sign", action="store_true", help="only check kronfluence's sign by experiment")
    ap.add_argument("--model", help="a Hugging Face model folder")
    ap.add_argument("--pool", type=Path)
    ap.add_argument("--target", type=Path)
    ap.add_argument("--out", type=Path, help="the attribution file (.parquet); OUT.json beside it")
    ap.add_argument("--max-length", type=int, help="each row's first tokens, as gradspec's --max-length")
    ap.add_argument("--modules", default=MODULES, help=f"linear modules by last name part (default {MODULES})")
    ap.add_argument("--factors", choices=STRATEGIES, default="ekfac", help="kronfluence's strategy")
    ap.add_argument("--damping", default="heuristic", help="kronfluence's damping_factor, or heuristic (None)")
    ap.add_argument("--empirical-fisher", action="store_true", help="fit the factors on the rows' own labels")
    ap.add_argument("--batch-size", type=int, default=4, help="rows per batch (factors and scores)")
    ap.add_argument("--workdir", type=Path, help="keep kronfluence's factors and scores here")
    ap.add_argument("--seed", type=int, default=0, help="for the Fisher's sampled labels")
    args = ap.parse_args(argv)
    if args.check_sign:
        check_sign()
        return {}
    missing = [f"--{k.replace('_', '-')}" for k in ("model", "pool", "target", "out", "max_length")
               if getattr(args, k) is None]
    if missing:
        ap.error(f"{', '.join(missing)} required")
    damping = None if args.damping == "heuristic" else float(args.damping)

    run = Run("kronfluence", importlib.metadata.version("kronfluence"), args.factors)
    import torch
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.utils.dataset import DataLoaderKwargs

    from gradspec.data.batching import pad_id_of

    tokenizer, pool, target, model = read_inputs(args)
    modules = tracked_modules(model, args.modules)
    task = make_task(modules)
    model = prepare_model(model, task)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kronfluence-"))
    analyzer = Analyzer("gradspec", model, task, cpu=True, disable_tqdm=True, output_dir=str(work))
    analyzer.set_dataloader_kwargs(DataLoaderKwargs(collate_fn=collate(pad_id_of(tokenizer))))
    train = ListDataset([pool.tokens[i] for i in pool.scored])
    query = ListDataset(target.tokens)
    started = time.perf_counter()
    analyzer.fit_all_factors("factors", train, per_device_batch_size=args.batch_size, overwrite_output_dir=True,
                             factor_args=FactorArguments(strategy=args.factors,
                                                         use_empirical_fisher=args.empirical_fisher))
    fitted = time.perf_counter()
    analyzer.compute_pairwise_scores("scores", "factors", query_dataset=query, train_dataset=train,
                                     per_device_query_batch_size=args.batch_size,
                                     per_device_train_batch_size=args.batch_size, overwrite_output_dir=True,
                                     score_args=ScoreArguments(damping_factor=damping))
    phases = {"factors_seconds": round(fitted - started, 3), "scores_seconds": round(time.perf_counter() - fitted, 3)}
    scores = analyzer.load_pairwise_scores("scores")["all_modules"].double().numpy()  # (targets, scored pool rows)
    frame = attribution_frame(scores, pool.scored, len(pool.tokens), "kronfluence")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = run.write(args.out, frame, modules=args.modules, max_length=args.max_length,
                       rows=len(pool.tokens), targets=len(target.tokens), scored_rows=len(pool.scored),
                       damping=args.damping, fisher="empirical" if args.empirical_fisher else "true",
                       batch_size=args.batch_size, tracked=len(modules), **phases, model=str(args.model),
                       torch=torch.__version__, threads=torch.get_num_threads(), workdir=str(work))
    print(f"{len(pool.scored)} pool x {len(target.tokens)} target scores -> {args.out} "
          f"({record['seconds']:.1f} s, peak RSS {record['peak_rss_mib']:.0f} MiB)")
    return record


if __name__ == "__main__":
    main()
