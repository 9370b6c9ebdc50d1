"""Trunk replicas over torch.distributed: starting them, their collectives and aggregation."""
