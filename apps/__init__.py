"""The Flower ClientApp and ServerApp that ``flwr run .`` starts."""
