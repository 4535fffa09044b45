"""Data parallelism: the flat gradient buffer, DDP with ZeRO-1/2/3, and PyTorch's FSDP2."""
