"""Shared-memory regions (host or CUDA IPC) for a client on the trunk's host."""
