"""`kvtier config check|show`: validate a policy and print it resolved."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
import yaml
from rich.console import Console

from kvtier.store.base.config import load_policy

app = typer.Typer(no_args_is_help=True, help="Validate and print tier policies.")


@app.command("check")
def check(file: Path = typer.Argument(..., help="policy YAML file"),
          as_json: bool = typer.Option(False, "--json", help="print the policy as JSON")) -> None:
    """Validate FILE and print the resolved policy; exit code 2 if it is invalid."""
    show(file, as_json)


@app.command("show")
def show(file: Optional[Path] = typer.Argument(None, help="policy file (default: built in)"),
         as_json: bool = typer.Option(False, "--json", help="print the policy as JSON")) -> None:
    """Print the resolved policy (the embedded default when no FILE is given)."""
    policy = load_policy(file)
    data = policy.to_dict()
    if as_json:
        print(json.dumps(data, indent=2))
        return
    console = Console()
    console.print(f"[green]ok[/green] {policy.source}")
    console.print(yaml.safe_dump(data, sort_keys=False), end="", markup=False, highlight=False)
