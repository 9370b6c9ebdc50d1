"""Inference sessions and batched decoding on the trunk."""
