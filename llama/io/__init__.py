"""Files: checkpoints (with the safetensors format), Hugging Face folders, and the run folder."""
