"""kvtier.tools.commands: the command groups of the `kvtier` CLI, one module each. Nothing
outside the CLI imports them.
"""
