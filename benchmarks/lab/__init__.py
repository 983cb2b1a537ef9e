"""The quality lab: procedural data, metrics, pure-torch references of the lab models, harness (not installed)."""
