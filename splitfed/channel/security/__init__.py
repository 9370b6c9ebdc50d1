"""How the split channel is secured: TLS, zero-configuration TLS, TLS for bulk links, client tokens."""
