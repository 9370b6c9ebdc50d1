"""Bulk links: the tensor bytes of streamed calls over plain TCP connections beside gRPC."""
