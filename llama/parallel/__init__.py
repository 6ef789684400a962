"""Several GPUs: the launchers' environment and rendezvous, NCCL, ZeRO-1, and the launcher itself."""
