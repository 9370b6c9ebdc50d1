"""The client side of the split channel: TrunkClient and the trunk as an nn.Module."""
