"""Benchmarks comparing ART's asyncio PipelineTrainer with art_trio."""
