"""Layer 7, the facade: `PipelineTrainer` and its parts (start-up, the stages' supervision)."""
