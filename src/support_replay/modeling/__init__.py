"""Model plumbing shared by the engine and the trainer: the batch-invariant forward of
true-on-policy mode, and the conversion of the packaged SmolLM2 checkpoint."""
