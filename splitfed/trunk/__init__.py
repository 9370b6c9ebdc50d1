"""Trunk runtime and aggregation: pure torch, no gRPC, no Flower."""
