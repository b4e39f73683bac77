"""Optimizer / DDP / grad clipping (filled below)."""
PATCHES = []
