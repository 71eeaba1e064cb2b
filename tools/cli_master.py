"""`kvtier master` (the Mooncake master in the foreground) and `kvtier demo`."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from kvtier.store.config import load_policy
from kvtier.store.master import EmbeddedMaster

POLICY_OPT = typer.Option(None, "--policy", "-p", help="policy YAML (default: built in)")


def master(policy: Optional[Path] = POLICY_OPT,
           log: Optional[Path] = typer.Option(None, help="write the master's log here")) -> None:
    """Run the Mooncake master with the policy's settings in the foreground (Ctrl-C stops)."""
    cfg = load_policy(policy).master
    console = Console()
    with EmbeddedMaster(cfg, log_path=log) as m:
        console.print(f"mooncake_master answering on [bold]{m.address}[/bold] "
                      f"(metrics {m.metrics_url}); Ctrl-C to stop")
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
        try:
            while m.alive():
                time.sleep(0.5)
        except KeyboardInterrupt:
            console.print("stopping")
    if m.proc is None:
        return


def demo(policy: Optional[Path] = POLICY_OPT,
         sessions: int = typer.Option(2, min=1, help="sessions to replay"),
         turns: int = typer.Option(3, min=1, help="turns per session")) -> None:
    """The smallest end-to-end run: master, every tier, blocks through the store."""
    from kvtier.tools.demo import run_demo

    run_demo(policy, sessions=sessions, turns=turns)
