"""`gradspec diagnose`: which training samples a fine-tuned model did not learn, and why."""
