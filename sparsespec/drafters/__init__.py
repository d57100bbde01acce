"""Trained DFlash drafters shipped with the package (see spec/registry.py)."""
