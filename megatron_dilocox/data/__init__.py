"""Data pipeline: corpus building, tokenizers and indexed-dataset helpers."""
