"""Text to tokens: the tokenizer and its download, token shards, the data loader, datasets, downloads, the starter pack."""
