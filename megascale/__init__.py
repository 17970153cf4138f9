"""megascale: GPT pretraining with tensor, sequence, pipeline, data and context parallelism."""

__version__ = "0.1.0"
