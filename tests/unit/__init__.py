"""Fast CPU tests of the package's parts, one at a time: config, optimizer, reference model, tokenizers, loaders, HF I/O."""
