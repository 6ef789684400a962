"""The models: the numpy reference (the oracle and the CPU backend), the GPU models in fp32 and bf16, and the GPU decoder."""
