"""The split channel: the only gRPC code of splitfed."""
