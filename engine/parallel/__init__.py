"""Parallelisms: one file per technique, one apply_* entry each."""
