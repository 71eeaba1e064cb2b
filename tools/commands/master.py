"""`kvtier master` (the Mooncake master in the foreground) and `kvtier demo` (`tools.commands.demo`)."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Optional

import typer
from pydantic import ValidationError
from rich.console import Console

from kvtier.store.base.config import MasterConfig, load_policy
from kvtier.store.base.config_errors import format_validation_error
from kvtier.store.base.errors import ConfigError
from kvtier.store.base.index import make_private_dirs
from kvtier.tiers.mooncake.master import EmbeddedMaster

POLICY_OPT = typer.Option(None, "--policy", "-p", help="policy YAML (default: built in)")


def master(policy: Optional[Path] = POLICY_OPT,
           log: Optional[Path] = typer.Option(None, help="write the master's log here "
                                              "(default with --detach: the policy's run dir)"),
           detach: bool = typer.Option(False, "--detach", help="start it in the background, "
                                       "wait until it answers, and return; it runs until "
                                       "stopped (kill the pid --pid-file names)"),
           pid_file: Optional[Path] = typer.Option(None, "--pid-file",
                                                   help="with --detach: write its pid here"),
           ha: bool = typer.Option(False, "--ha", help="Mooncake's HA mode: join the "
                                   "election of the masters sharing the etcd endpoints "
                                   "(implied by --etcd or the policy's master.etcd)"),
           etcd: Optional[str] = typer.Option(None, "--etcd", metavar="HOST:PORT,...",
                                              help="etcd endpoints for --ha (default: the "
                                              "policy's master.etcd)"),
           address: Optional[str] = typer.Option(None, "--address", metavar="HOST:PORT",
                                                 help="bind the master's RPC here (default: "
                                                 "the policy's master.address)"),
           ) -> None:
    """Run the Mooncake master with the policy's settings in the foreground (Ctrl-C stops),
    or with --detach in the background: the one master several engines of a node join,
    which none of them owns (an embedded master lives and dies with its first user).

    With --ha every master started on the same etcd endpoints campaigns: the first to win
    leads and serves, the others stand by, and when the leader is lost one of them takes
    over (README, "Master high availability")."""
    cfg = _master_config(load_policy(policy).master, ha, etcd, address)
    console = Console()
    if detach:
        m = EmbeddedMaster(cfg, log_path=log or cfg.runtime_dir / f"master-{cfg.port}.log")
        make_private_dirs(m.log_path.parent)
        m.detached = True
        m.start()
        if pid_file is not None:
            pid_file.write_text(f"{m.proc.pid}\n")
        console.print(f"{_joined(m)}, pid {m.proc.pid}, log {m.log_path}")
        return
    with EmbeddedMaster(cfg, log_path=log) as m:
        console.print(f"{_joined(m)} (metrics {m.metrics_url}); Ctrl-C to stop")
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
        try:
            while m.alive():
                time.sleep(0.5)
        except KeyboardInterrupt:
            console.print("stopping")


def _master_config(cfg: MasterConfig, ha: bool, etcd: str | None,
                   address: str | None) -> MasterConfig:
    """The policy's master settings with the command line's on top."""
    data = cfg.model_dump(by_alias=False)
    if address is not None:
        data["address"] = address
    if etcd is not None:
        data["etcd"] = etcd
    if ha and not data["etcd"]:
        raise typer.BadParameter("--ha needs etcd endpoints: give --etcd HOST:PORT,... or "
                                 "set master.etcd in the policy", param_hint="--ha")
    if data["etcd"]:
        data["embedded"] = False  # an HA master is the operator's by definition
    try:
        return MasterConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, "kvtier master", MasterConfig)) from None


def _joined(m: EmbeddedMaster) -> str:
    """What the started master is: where it answers, or in HA mode the role it won."""
    if not m.cfg.ha:
        return f"mooncake_master answering on [bold]{m.address}[/bold]"
    health = m.health() or {}
    role = ("[bold]leader[/bold]" if health.get("role") == "leader" else
            f"[bold]standby[/bold] behind the leader {health.get('leader_address', '?')}")
    return (f"mooncake_master {m.address} joined the election through etcd "
            f"{','.join(m.cfg.etcd)}: {role}")


def pool_service(policy: Optional[Path] = POLICY_OPT) -> None:
    """Run the node's pool service for the policy's mooncake tier in the foreground: the
    segment every kvtier process on this node joins through shared memory (the tier's
    `service` address). Ctrl-C stops it."""
    from kvtier.store.base.errors import MasterError
    from kvtier.tiers.mooncake.service import PoolService

    pol = load_policy(policy)
    tier = next((t for t in pol.tiers if t.kind == "mooncake" and t.service), None)
    if tier is None:
        raise typer.BadParameter("the policy has no mooncake tier with a `service` address; "
                                 "set tiers[dram].service: 127.0.0.1:50052", param_hint="policy")
    console = Console()
    try:
        service = PoolService(tier, pol.master).start()
    except MasterError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from None
    console.print(f"pool service for tier {tier.name!r} answering on [bold]{service.address}"
                  f"[/bold], lending {tier.capacity_bytes >> 20} MiB to the master at "
                  f"{pol.master.address} (log {service.log_path}); Ctrl-C to stop")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        while service.alive():
            time.sleep(0.5)
        console.print(f"[red]the pool service exited[/red]; see {service.log_path}")
        raise typer.Exit(1)
    except KeyboardInterrupt:
        console.print("stopping")
    finally:
        service.stop()


def demo(instances: int = typer.Option(4, min=1, help="vLLM engine processes"),
         sessions: int = typer.Option(8, min=1, help="agent sessions"),
         turns: int = typer.Option(8, min=1, help="turns per session"),
         scale: float = typer.Option(0.15, min=0.001, help="real tokens per workload token"),
         speed: float = typer.Option(4.0, min=0.001, help="time runs this much faster"),
         out: Path = typer.Option(Path("replay-out/demo"), help="report and plots go here"),
         dram_only: bool = typer.Option(False, help="also run the DRAM-only pool")) -> None:
    """The main job, scaled: real vLLM engines on kvtier vs their own prefix caches."""
    from kvtier.tools.commands.demo import run_demo

    run_demo(instances=instances, sessions=sessions, turns=turns, scale=scale, speed=speed,
             out=out, baselines=("local", "dram-only") if dram_only else ("local",))
