"""Models: by name, pretrained LLMs, their parts, LoRA adapters, export."""
