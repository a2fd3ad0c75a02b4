#!/usr/bin/env bash
# Reproduces docs/findings.md: score the published subsets with SmolLM2-135M-Instruct on the CPU
# (first 50 samples of each file), then compare high vs low per source and reasoning vs instruction.
set -euo pipefail
cd "$(dirname "$0")/.."
D=../shared/data/gradient_unified
OUT=${OUT:-findings}
mkdir -p "$OUT"
for metric in ifd_gpt2 reward; do
  for source in wiz her mag; do
    for side in highest lowest; do
      .venv/bin/gradspec score --data "$D/$metric/${source}_10k_${side}_200.json" --limit 50 --classic \
        --out "$OUT/${metric}_${source}_${side}.parquet" --overwrite --quiet
    done
    .venv/bin/gradspec report "high=$OUT/${metric}_${source}_highest.parquet" \
      "low=$OUT/${metric}_${source}_lowest.parquet" --out "docs/findings/${metric}_${source}"
  done
done
.venv/bin/gradspec score --data "$D/reasoning/gsm8k_R1.json" --limit 50 --classic \
  --out "$OUT/reasoning_gsm8k.parquet" --overwrite --quiet
.venv/bin/gradspec report "reasoning=$OUT/reasoning_gsm8k.parquet" "wiz_high=$OUT/ifd_gpt2_wiz_highest.parquet" \
  "wiz_low=$OUT/ifd_gpt2_wiz_lowest.parquet" --out docs/findings/reasoning_vs_instruction
