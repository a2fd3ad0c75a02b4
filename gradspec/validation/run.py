"""validate's retrains as a run, like score's: each retrain is one chunk of a run folder (runs.run_folder:
its part written whole or not at all, the manifest, the checks of a resume, the locks, shards, the
merge), so a killed run resumes where it stopped with the same results (a retrain is deterministic on
the CPU), --shard i/N spreads the retrains over processes, and under torchrun each rank takes its own.

The plan (which retrains there are) comes from the config alone: the LDS subsets, then the outcome's
selections, then the removal test's retrains, then the objectives' retrains of the whole pool; every
process makes the same plan, and retrain j is chunk j, its row's index."""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradspec.data.batching import BATCH_TOKENS, Item
from gradspec.data.errors import InputError, check_parquet_out, check_writable
from gradspec.data.models import DEFAULT_MODEL, fit_to_context, load_model
from gradspec.data.readers import Sample, data_samples, read_samples
from gradspec.data.templates import check_response_tokens, tokenize
from gradspec.options import OptionError
from gradspec.runs.distributed import Group, bind_device, torchrun_shard
from gradspec.runs.numerics import numerics
from gradspec.runs.run_folder import MODEL_IDENTITY, NUMERICS, RunFolder, Shard, model_identity
from gradspec.runs.scoring import start_folder
from gradspec.validation import objectives
from gradspec.validation.config import ValidateConfig, ValidateSettings, check
from gradspec.validation.lds import RESPONSE_TOKENS
from gradspec.validation.outcome import LENGTH, RANDOM
from gradspec.validation.outcome import plan as outcome_plan
from gradspec.validation.removal import REMOVAL, removal_count
from gradspec.validation.removal import plan as removal_plan
from gradspec.validation.retrain import Recipe, Retrainer
from gradspec.validation.scores import read_score
from gradspec.validation.subsets import lds_subset

log = logging.getLogger("gradspec")

LDS, OUTCOME = "lds", "outcome"


@dataclass(frozen=True)
class Job:
    """One retrain of the plan: LDS subset number or outcome selection (name, buckets) or removal (score, the
    end removed), seed, share, members."""

    kind: str
    subset: int | None
    selection: str | None
    buckets: int
    seed: int
    fraction: float
    members: list[int]
    removed: str | None = None  # the removal test's: top, bottom or random


@dataclass
class Pool:
    """The training rows a retrain may draw (those with response tokens), their tokens, and the targets."""

    rows: int  # the input's rows (row indices run 0 ... rows - 1)
    tokens: dict[int, Any]  # row index -> Tokenized, for the pool's rows
    targets: list[Item]

    @property
    def indices(self) -> list[int]:
        return sorted(self.tokens)

    def response_tokens(self) -> list[int | None]:
        """Each input row's response tokens as trained on (None: not in the pool): what length predicts,
        recorded so that the analysis can take it out of every score's LDS."""
        return [self.tokens[i].num_response_tokens if i in self.tokens else None for i in range(self.rows)]


def job_count(config: ValidateConfig) -> int:
    """How many retrains the plan holds, from the config alone (plan makes them)."""
    per_seed = 2 + len(config.outcome) * (2 if config.length_buckets else 1) if config.outcome else 0
    return config.subsets + config.seeds * per_seed + removal_count(config.removal, config.seeds) + \
        objectives.count(config)


def outcome_scores(config: ValidateConfig, rows: int, targets: int, option: str = "outcome") -> dict[str, Any]:
    """The outcome's scores (or option's: removal), one value per row index (an attribution: its mean over
    targets), read before the model loads so that a bad file is named at once."""
    scores: dict[str, Any] = {}
    specs = getattr(config, option)
    pool = config.describe() if specs else None  # what the scores must have scored: the pool's data
    for spec in specs:
        score = read_score(spec, rows, targets, pool)
        if score.name in scores or score.name in (RANDOM, LENGTH):
            raise OptionError(option, f"{spec}: a second score named {score.name}; give each another file or "
                              "column")
        scores[score.name] = score.per_sample()
        lacking = int(np.isnan(scores[score.name]).sum())
        if lacking:
            log.warning("%s: %d of %d rows have no value (NaN, inf, or not in the file); the %s take them last",
                        spec, lacking, rows, "selections" if option == "outcome" else "removals at either end")
    return scores


def plan(config: ValidateConfig, pool: Pool, scores: dict[str, Any],
         removal: dict[str, Any] | None = None) -> list[Job]:
    """Every retrain, in chunk order: the LDS subsets, then each seed's outcome selections by scores, then each
    seed's removals by removal's scores, then each seed's objectives (NTP first) on the whole pool."""
    jobs = [Job(LDS, k, None, 0, config.seed, config.fraction,
                lds_subset(pool.indices, config.fraction, config.seed, k)) for k in range(config.subsets)]
    if config.outcome:
        num_tokens = {i: t.num_tokens for i, t in pool.tokens.items()}
        response = {i: t.num_response_tokens for i, t in pool.tokens.items()}
        for s in outcome_plan(scores, pool.indices, num_tokens, response, config.top, config.seeds,
                              config.length_buckets, config.seed):
            jobs.append(Job(OUTCOME, None, s.name, s.buckets, config.seed + s.seed, config.top, s.members))
    if config.removal:
        for r in removal_plan(removal or {}, pool.indices, config.remove, config.seeds, config.seed):
            jobs.append(Job(REMOVAL, None, r.name, 0, config.seed + r.seed, len(r.kept) / len(pool.indices),
                            r.kept, r.removed))
    jobs += [Job(objectives.OBJECTIVE, None, name, 0, config.seed + s, 1.0, pool.indices)
             for name, s in objectives.plan(config)]
    if len(jobs) != job_count(config):
        raise RuntimeError(f"the plan holds {len(jobs)} retrains, job_count {job_count(config)}")
    return jobs


def read_rows(config: ValidateConfig) -> tuple[list[Sample], list[Sample]]:
    """The training rows and the target examples, read before the model loads (a malformed row is named
    at once)."""
    samples = list(data_samples(config.data, config.fields, config.limit))
    targets = list(read_samples(config.target, config.fields))
    if not targets:
        raise InputError(f"{config.target}: no rows; the retrains measure the loss of its examples")
    return samples, targets


def read_pool(config: ValidateConfig, samples: list[Sample], targets: list[Sample], tokenizer,
              max_length: int) -> Pool:
    """The rows and targets tokenized as gradspec scores them; the pool is the rows with response tokens.
    Stops where most rows have none (a template or tokenizer problem, not the data)."""
    tokens = {s.index: tokenize(s.messages, tokenizer, config.template, max_length) for s in samples}
    check_response_tokens(Counter(t.status for t in tokens.values()))
    usable = {i: t for i, t in tokens.items() if t.scorable and t.num_response_tokens > 0}
    if len(usable) < 2:
        raise InputError(f"{config.data or 'humaneval'}: {len(usable)} rows with response tokens; retraining on "
                         "subsets needs 2 or more")
    items = [Item(s, tokenize(s.messages, tokenizer, config.template, max_length)) for s in targets]
    unusable = sum(not t.tokens.num_response_tokens for t in items)
    if unusable:
        log.warning("%d of %d target examples have no response token: their loss is NaN, and they count in no LDS",
                    unusable, len(items))
    return Pool(len(samples), usable, items)


def row(index: int, job: Job, result) -> dict[str, Any]:
    """The retrain's row of the output."""
    return {"index": index, "kind": job.kind, "subset": job.subset, "selection": job.selection,
            "buckets": job.buckets, "seed": job.seed, "fraction": job.fraction, "members": job.members,
            "target_loss": result.target_loss, "train_loss": result.train_loss, "steps": result.steps,
            "metric": result.metric, "seconds": result.seconds, "removed": job.removed}


def retrain(config: ValidateConfig, settings: ValidateSettings, shard: Shard | None = None,
            merge: bool = True) -> int:
    """Runs this process's retrains into the run folder of settings.out, then merges them into out when this
    process is the whole run (or torchrun's rank 0) and merge is on. Returns the retrains this process ran
    (0: out was already complete)."""
    metric = check(config, settings)
    ranks = torchrun_shard()
    if ranks is not None and shard is not None:
        raise OptionError("shard", "and torchrun both split the retrains; use one of them")
    mine = ranks or shard or Shard()
    out, folder = settings.out, RunFolder(settings.out)
    check_parquet_out(out)
    check_writable(out)
    identity = model_identity(config.model)
    info = {**config.describe(), **(identity or {}), NUMERICS: numerics(settings.device, BATCH_TOKENS)}
    unknown = () if identity else MODEL_IDENTITY
    if settings.resume and folder.complete(info, unknown):
        return 0
    if ranks is None or mine.index == 0:
        folder.check(info, settings.resume, settings.overwrite, shards=1 if ranks else mine.count,
                     shard=None if ranks else mine, unknown=unknown)
    if settings.resume and ranks is None and mine.count == 1 and set(range(job_count(config))) <= folder.done():
        folder.merge(job_count(config), 1)  # every retrain done (by shards, say): only the merge is left
        return 0
    samples, targets = read_rows(config)
    scores = outcome_scores(config, len(samples), len(targets))
    removal = outcome_scores(config, len(samples), len(targets), "removal")
    with Group() if ranks else nullcontext() as group:
        device = bind_device(settings.device) if ranks else settings.device
        model, tokenizer = load_model(config.model, device, progress=settings.progress)
        pool = read_pool(config, samples, targets, tokenizer, fit_to_context(config.max_length, model))
        jobs = plan(config, pool, scores, removal)
        info = {**info, **(identity or model_identity(config.model) or
                           {"model_path": config.model or DEFAULT_MODEL, "model_fingerprint": None})}
        if group is not None:
            info = group.share(info)  # one description of the run in every rank's parts
        recipe = Recipe(config.epochs, config.max_steps, config.batch_size, config.learning_rate, config.lora_rank)
        retrainer = Retrainer(model, tokenizer, pool.tokens, pool.targets, recipe, metric)
        losses = _objective_losses(config, retrainer)
        metadata = {**info, "rows": pool.rows, "pool": len(pool.tokens), "targets": len(pool.targets),
                    RESPONSE_TOKENS: pool.response_tokens(), "start_target_loss": retrainer.target_losses()}
        try:
            created = _start(folder, info, group, mine, settings, len(jobs))
            done = folder.done()
            todo = [j for j in range(len(jobs)) if mine.owns(j) and j not in done]
            try:
                for j in _progress(todo, settings.progress and mine.index == 0):
                    objective = losses.get(jobs[j].selection) if jobs[j].kind == objectives.OBJECTIVE else None
                    folder.write_part(j, [row(j, jobs[j], retrainer(jobs[j].members, jobs[j].seed, objective))],
                                      metadata)
            except BaseException:
                if created:
                    folder.abandon()  # stopped before any part: no run left to --resume
                raise
            if group is not None:
                group.wait()
            if merge and mine.index == 0 and (group is not None or mine.count == 1):
                folder.merge(len(jobs), 1)
        finally:
            folder.release()
    return len(todo)


def _objective_losses(config: ValidateConfig, retrainer: Retrainer) -> dict[str, Any]:
    """Each of --objectives' losses by name (NTP, the retrains' own, is none); SFTMix's confidence measured
    now, under the start weights."""
    if not config.objectives:
        return {}
    from gradspec.validation.objective_losses import WIT, SFTMix

    made = {"wit": lambda: WIT(config.prompt_weight, config.response_weight),
            "sftmix": lambda: SFTMix.at_start(retrainer.model, retrainer.tokenizer, retrainer.rows,
                                              retrainer.batch_tokens)}
    return {name: made[name]() for name in config.objectives}


def _start(folder: RunFolder, info: dict[str, Any], group: Group | None, mine: Shard, settings: ValidateSettings,
           records: int) -> bool:
    """scoring.start_folder with the settings' resume and overwrite."""
    return start_folder(folder, info, group, mine, settings.resume, settings.overwrite, records)


def _progress(todo: list[int], shown: bool):
    if not shown:
        return todo
    from tqdm import tqdm

    return tqdm(todo, desc="retrains", unit="retrain")

