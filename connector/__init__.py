"""kvtier.connector."""
