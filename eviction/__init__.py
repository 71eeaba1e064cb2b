"""kvtier.eviction."""
