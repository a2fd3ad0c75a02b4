"""bergson's own attribution scores of a pool against a target, for comparison with gradspec.

Run with the interpreter of the venv made by benchmarks/peers/bergson_env.sh (bergson 2.5.1 is
not a dependency of gradspec and is never imported by it):

    OUT/.venv-bergson/bin/python benchmarks/peers/bergson_scores.py --model FOLDER \
        --pool pool.jsonl --target target.jsonl --out scores.parquet \
        [--projection 0] [--preconditioner none|kfac|ekfac|shampoo|tkfac] [--cosine]

What it computes: for every pool row i and target row j, bergson's score
<g_pool_i, P g_target_j> of the per-example loss gradients (all linear weight
matrices, bias excluded: bergson's default modules), where
- the loss is the next-token cross-entropy on the response tokens only, the prompt
  masked, summed over those tokens (bergson's `loss_reduction="sum"`; `--loss-reduction
  mean` averages them instead);
- the rows are rendered as gradspec's plain template renders them: text =
  instruction (+ "\\n" + input) + "\\n" + output, with the tokenizer's special tokens,
  and the labelled tokens are those whose text starts inside the output (as
  gradspec/data/templates.py `_offset_labels`), cut to the first `--max-length` tokens
  where given (gradspec's truncation). The driver tokenizes itself and hands
  bergson a pre-tokenized dataset (input_ids, labels), which bergson uses as is;
- `--projection D` > 0: bergson's random (Rademacher, JL-scaled, per-module
  two-sided) projection of each gradient to D dimensions per module; 0: none;
- P is the identity for `--preconditioner none`, else the inverse of a
  Kronecker-factored Gauss-Newton Hessian fitted on the pool (bergson's
  HessianConfig.method kfac / shampoo / tkfac; ekfac = kfac with eigenvalue
  correction), damped by bergson's default `damped_inverse` with damping_factor 0.1,
  the Fisher's labels sampled from the model (bergson's `use_dataset_labels=False`) on the
  response positions; kfac/ekfac were run (2026-12-03), shampoo/tkfac only wired up.
  bergson's Adam preconditioning (IndexConfig.optimizer_state: second moments from a
  saved optimizer state) needs a training run's optimizer and is not offered here;
- `--cosine` unit-normalizes the gradients first (cosine similarity; not with a
  factored preconditioner, which bergson refuses).

bergson API called: `bergson.build.build_query` (the target's gradient index, one row
per target, `aggregation="none"`) then `bergson.score.score.score_dataset` (scores the
pool against it, `score="individual"`) for `none`; `bergson.hessians.pipeline.
hessian_pipeline` (the `bergson ekfac` command: query build, Hessian fit on the pool,
inverse applied to the target gradients, scoring) for the factored preconditioners;
`bergson.data.load_scores` to read the store.

Output (Parquet if --out ends in .parquet, else CSV): columns pool_index,
target_index, score — one row per (pool, target) pair — plus a row per pool index
with target_index "mean" holding the mean of its scores over the targets.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

PRECONDITIONERS = ("none", "kfac", "ekfac", "shampoo", "tkfac")


def plain_rows(path: Path, tokenizer, max_length: int | None = None) -> list[dict]:
    """Alpaca JSONL -> [{input_ids, labels}] as gradspec's plain template labels them (and, with
    max_length, truncates them: the first max_length tokens)."""
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        prompt = row["instruction"] + ("\n" + row["input"] if row.get("input") else "")
        text = prompt + "\n" + row["output"]
        start = len(prompt) + 1
        enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
        ids = enc["input_ids"]
        labels = [
            i if b > a and a >= start else -100
            for i, (a, b) in zip(ids, enc["offset_mapping"], strict=True)
        ]
        out.append({"input_ids": ids[:max_length], "labels": labels[:max_length]})
    return out


def write_jsonl(rows: list[dict], path: Path) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a Hugging Face model folder")
    ap.add_argument("--pool", required=True, type=Path)
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--projection", type=int, default=0, help="dims per module; 0: none")
    ap.add_argument("--preconditioner", choices=PRECONDITIONERS, default="none")
    ap.add_argument("--cosine", action="store_true", help="unit-normalize the gradients")
    ap.add_argument("--loss-reduction", choices=("sum", "mean"), default="sum")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp64"), default="fp32")
    ap.add_argument("--workdir", type=Path, help="keep bergson's stores here")
    ap.add_argument("--max-length", type=int, help="keep each row's first tokens, as gradspec's --max-length")
    args = ap.parse_args()

    import numpy as np
    import pandas as pd
    from bergson.config.config import (
        DataConfig,
        HessianConfig,
        HessianPipelineConfig,
        IndexConfig,
        PreprocessConfig,
        QuerySetConfig,
        ScoreConfig,
    )
    from bergson.data import load_scores
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bergson-"))
    work.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(args.model)
    pool = write_jsonl(plain_rows(args.pool, tok, args.max_length), work / "pool.jsonl")
    target = write_jsonl(plain_rows(args.target, tok, args.max_length), work / "target.jsonl")

    def index_cfg(run: str, data: str) -> IndexConfig:
        return IndexConfig(
            run_path=str(work / run), overwrite=True, model=args.model,
            precision=args.precision, data=DataConfig(dataset=data),
            projection_dim=args.projection, loss_reduction=args.loss_reduction,
        )

    preprocess = PreprocessConfig(unit_normalize=args.cosine)
    query = QuerySetConfig(dataset=target, aggregation="none")
    score_cfg = ScoreConfig(score="individual")
    if args.preconditioner == "none":
        from bergson.build import build_query
        from bergson.score.score import score_dataset

        score_cfg.query_path = build_query(index_cfg("query", target), query, preprocess)
        score_dataset(index_cfg("scores", pool), score_cfg, preprocess)
        scores_dir = work / "scores"
    else:
        from bergson.hessians.pipeline import hessian_pipeline

        method = "kfac" if args.preconditioner == "ekfac" else args.preconditioner
        hessian = HessianConfig(method=method, ev_correction=args.preconditioner == "ekfac")
        hessian_pipeline(index_cfg("run", pool), hessian, score_cfg, preprocess,
                         HessianPipelineConfig(query=query))
        scores_dir = work / "run" / "scores"

    store = load_scores(scores_dir)
    grid = np.asarray(store[:], dtype=np.float64)  # [pool, target]
    n_pool, n_target = grid.shape
    frame = pd.DataFrame({
        "pool_index": np.repeat(np.arange(n_pool), n_target + 1),
        "target_index": [str(j) for _ in range(n_pool) for j in [*range(n_target), "mean"]],
        "score": np.concatenate([grid, grid.mean(1, keepdims=True)], 1).ravel(),
    })
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.suffix == ".parquet":
        frame.to_parquet(args.out, index=False)
    else:
        frame.to_csv(args.out, index=False)
    print(f"{n_pool} pool x {n_target} target scores -> {args.out} "
          f"({time.perf_counter() - t0:.1f} s, bergson stores in {work})")


if __name__ == "__main__":
    main()
