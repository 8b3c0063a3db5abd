"""Optax training of draft heads with Orbax checkpoints (EAGLE, ReDrafter, exit heads)."""
