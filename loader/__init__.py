"""Checkpoint reading, packing, the expert arena, readers and host caches."""
