"""Tensors in gRPC messages: a channel's lanes and streamed calls."""
