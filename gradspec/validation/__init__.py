"""`gradspec validate`: whether a score predicts what training does to the model.

Retrains from the same start on random subsets of the pool (the linear datamodeling score, LDS)
on the top of the pool by each score (the selection outcome) and on the pool less each score's top
or bottom (the removal test), measures every target example's loss after each, and compares those
losses with what the scores predicted.

config (ValidateConfig: the options), subsets (which rows each LDS retrain sees), retrain (one
fine-tuning from the start weights, then the targets' losses), scores (score files read as
attributions or per-sample values), lds (the score's predictions against the losses), outcome
(the selections and their paired differences against random), removal (the pool less a score's
top or bottom, against random removal), objectives (the whole pool retrained with plain next-token
training and with WIT or SFTMix, and their gains over it; objective_losses: those losses as a retrain
takes them), run (the retrains as chunks of a run folder: resume, shards, torchrun), report (the
analysis in Markdown and figures).
"""
