"""Dataset preparation scripts; prepared shards land in subfolders here by default."""
