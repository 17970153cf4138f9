"""Sharded, asynchronous, deduplicated, resharding checkpoints and HuggingFace conversion.

`CheckpointManager` (manager.py) is the entry point; see docs/checkpoint.md for the format.
"""

from megascale.checkpoint.format import CheckpointError
from megascale.checkpoint.manager import CheckpointManager, resolve_checkpoint

__all__ = ["CheckpointError", "CheckpointManager", "resolve_checkpoint"]
