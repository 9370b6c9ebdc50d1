"""The trunk server: listeners, the servicer, dispatch to model units, registry, health, metrics, admin."""
