"""Step checkpoints (torch.distributed.checkpoint) and the final adapter / merged exports."""
