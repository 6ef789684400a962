"""Several GPUs: the launchers' environment and rendezvous, NCCL, ZeRO (stages 1-3), and the launcher itself."""
