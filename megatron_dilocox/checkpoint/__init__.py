"""Checkpoints: Megatron-style iter_XXXXXXX folders, exact resume, resharding, conversion."""
