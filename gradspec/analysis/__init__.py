"""What to do with scores: reports comparing groups, and selection."""
