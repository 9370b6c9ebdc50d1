"""What both ends of the split channel agree on: protobuf messages <-> tensors, frames, limits, replies."""
