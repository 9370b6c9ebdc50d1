"""The cut's tensors on and off the trunk's device: transfers, pinned buffers, placement."""
