"""Target-aware selection: how well each sample's exact gradient aligns with a task's gradients."""
