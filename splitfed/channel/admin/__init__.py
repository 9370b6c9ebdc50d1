"""The model admin service: list, load, unload and reload the models of a trunk server (its own token)."""
