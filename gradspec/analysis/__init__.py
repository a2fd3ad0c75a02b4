"""What to do with scores: classic data-quality scores, reports comparing groups, and selection."""
