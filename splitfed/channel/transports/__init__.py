"""Ways to move a cut's tensors: gRPC, shared-memory regions (and CUDA IPC), bulk TCP links, direct calls."""
