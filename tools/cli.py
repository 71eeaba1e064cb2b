"""The `kvtier` command line. Each command group lives in its own module under `tools/commands/`."""

from __future__ import annotations

import sys

import typer
import typer.core

from kvtier.store.base.errors import ConfigError, KVTierError
from kvtier.tools.commands import bench as cli_bench
from kvtier.tools.commands import config as cli_config
from kvtier.tools.commands import inspect as cli_inspect
from kvtier.tools.commands import master as cli_master
from kvtier.tools.commands import replay as cli_replay

# Help in click's plain form (it wraps to the terminal), with click's metavars: typer shows
# `<str>`, `<int range>` and `<bool>` beside every option, noise a user must read past.
_METAVARS = {"str": "TEXT", "int": "N", "int range": "N", "float": "X", "float range": "X",
             "path": "PATH", "bool": ""}
_display_type = getattr(typer.core.TyperOption, "display_type", None)


def _plain_metavar(self, ctx) -> str:
    label = _display_type(self, ctx).strip("<>")
    return _METAVARS.get(label, label.upper())


if _display_type is not None:
    typer.core.TyperOption.display_type = _plain_metavar
    typer.core.TyperArgument.display_type = _plain_metavar

app = typer.Typer(rich_markup_mode=None, add_completion=False, no_args_is_help=True,
                  help="kvtier: a tiered KV-cache store for agentic LLM serving.")
app.add_typer(cli_config.app, name="config")
app.add_typer(cli_inspect.app, name="inspect")
app.add_typer(cli_bench.app, name="bench")
app.command("master")(cli_master.master)
app.command("pool-service")(cli_master.pool_service)
app.command("demo")(cli_master.demo)
app.command("replay")(cli_replay.replay)


def main() -> None:
    """Entry point: run the app; kvtier's own errors print one line, not a traceback."""
    try:
        # Without standalone mode click returns a typer.Exit's code instead of exiting.
        code = app(standalone_mode=False)
        if isinstance(code, int) and code:
            sys.exit(code)
    except ConfigError as e:  # 3: invalid configuration; 2 stays click's usage errors
        print(f"kvtier: {e}", file=sys.stderr)
        sys.exit(3)
    except KVTierError as e:
        print(f"kvtier: {e}", file=sys.stderr)
        sys.exit(1)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print("kvtier: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # click usage errors carry their own exit code
        code = getattr(e, "exit_code", None)
        if code is None:
            raise
        if hasattr(e, "show"):
            e.show()
        sys.exit(code)


if __name__ == "__main__":
    main()
