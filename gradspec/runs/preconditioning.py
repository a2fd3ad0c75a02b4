"""The preconditioner an align run applies (gradspec.alignment.preconditioner), from its options:
K-FAC or EK-FAC factors read from --factors or fitted on the training data (and written there for
later runs), or a Trainer checkpoint's AdamW state."""

from __future__ import annotations

import logging
from pathlib import Path

from gradspec.alignment.adam import read_adam_state
from gradspec.alignment.kfac import KFACFactors, fit_factors
from gradspec.alignment.preconditioner import Preconditioner
from gradspec.files import sha256
from gradspec.options import OptionError, mention
from gradspec.runs.run_folder.fingerprints import model_identity
from gradspec.runs.task_set import task_batches

log = logging.getLogger("gradspec")


def run_preconditioner(config, engine, net, tokenizer, max_length: int, batch_tokens: int,
                       device, progress: bool = False) -> Preconditioner | None:
    """config's preconditioner for this engine's parts (None for precondition none); progress: a bar for
    each pass of a factor fit."""
    if config.precondition == "adam":
        state = read_adam_state(config.optimizer_state, net)
        return Preconditioner("adam", state.updates(engine.parts), state.describe())
    if config.precondition not in ("kfac", "ekfac"):
        return None
    factors = _factors(config, engine, tokenizer, max_length, batch_tokens, device, progress)
    described = {"damping": config.damping, "fitted_on": factors.provenance}
    if config.factors is not None:
        described["factors"] = {"path": str(Path(config.factors).resolve()), "sha256": sha256(config.factors)}
    return Preconditioner(config.precondition, factors.inverses(config.damping), described)


def _provenance(config, max_length: int) -> dict:
    """What factors fitted for this run are fitted on: compared with a factors file's before it is used."""
    data = config.fit_data or config.data
    identity = model_identity(config.model) or {}
    return {"data": str(Path(data).resolve()) if data is not None and Path(data).exists() else data or "humaneval",
            "limit": config.fit_limit, "model_fingerprint": identity.get("model_fingerprint"),
            "modules": config.modules, "template": config.template, "max_length": max_length}


def _factors(config, engine, tokenizer, max_length: int, batch_tokens: int, device,
             progress: bool = False) -> KFACFactors:
    """The factors file's, where it exists and was fitted as this run would fit them; else fitted now
    (and written to the factors file where one is named, its checksum beside it: KFACFactors.save, which
    never replaces a file)."""
    wanted = _provenance(config, max_length)
    path = config.factors
    if path is not None and factors_to_write(config) is None:
        factors = KFACFactors.load(path, engine.parts)
        if config.precondition == "ekfac" and factors.kind == "kfac":
            raise OptionError("factors", f"{path}: K-FAC factors only; EK-FAC needs the eigenvalue correction too: "
                              f"fit them again (another {mention('factors')} path)")
        recorded = {k: v for k, v in factors.provenance.items() if k in wanted}
        if recorded != wanted:
            differ = ", ".join(f"{k}: {recorded.get(k)!r} there, {v!r} here" for k, v in wanted.items()
                               if recorded.get(k) != v)
            raise OptionError("factors", f"{path}: fitted otherwise than this run fits them ({differ}); use another "
                              f"{mention('factors')} path, or this run's settings")
        log.info("K-FAC factors read from %s", path)
        return factors
    batches = task_batches(config.fit_data or config.data, tokenizer, config.fields, config.template, max_length,
                           batch_tokens, device, limit=config.fit_limit)
    factors = fit_factors(engine.backward_pass, engine.targets, batches, config.precondition, wanted, progress)
    if path is not None and factors.save(path):
        log.info("K-FAC factors written to %s", path)
    elif path is not None:
        log.warning("%s: written by another process while this one fitted its factors: left as it is, and this run "
                    "uses those it fitted", path)
    return factors


def factors_to_write(config) -> str | None:
    """The factors file a run of config fits and writes (None: it reads its factors file, or names none)."""
    fitted = config.precondition in ("kfac", "ekfac") and config.factors is not None
    return config.factors if fitted and not Path(config.factors).exists() else None

