"""`titan train`."""

from __future__ import annotations

from pathlib import Path

import typer

from titan.cli.common import CONFIG_OPTION, preflight, recipe_command
from titan.data import check_paths
from titan.errors import UserError
from titan.files import WRITE_ERRORS, write_error

# Exit status after a signal-triggered checkpoint: EX_TEMPFAIL, "try again later" (SLURM scripts requeue on it).
PREEMPTED_EXIT_CODE = 75
# After Ctrl-C's checkpoint: the shell's status for a command interrupted by SIGINT (128 + 2); a user's stop is
# not requeued.
INTERRUPTED_EXIT_CODE = 130


@recipe_command()
def train(ctx: typer.Context, config: Path = CONFIG_OPTION) -> None:
    """Train a model from a recipe.

    For example: titan train -c recipes/debug.toml --training.steps 30 --optimizer.lr 1e-3. Run alone, under `torchrun
    --nproc-per-node N`, or from a SLURM batch script. Every recipe key is listed below the options, with its type,
    default and meaning.
    """
    try:
        cfg = preflight(config, ctx.args)
        check_paths(cfg)
        from titan.train.recovery.failures import report
        from titan.train.stop import Preempted  # imported late: torch and friends take a while to import
        from titan.train.trainer import Trainer

        trainer = None
        try:
            trainer = Trainer(cfg)
            trainer.train()
        except Preempted as e:
            report(e, cfg.run_dir, trainer.step)  # under torchrun: why, for a restart's line
            typer.echo(f"titan: {e}", err=True)
            code = INTERRUPTED_EXIT_CODE if e.reason == "SIGINT" else PREEMPTED_EXIT_CODE
            raise typer.Exit(code=code) from None
        except UserError:
            raise
        except Exception as e:  # under torchrun: why, for the restart's line; a lost peer's in one line
            if report(e, cfg.run_dir, trainer.step if trainer is not None else None):
                raise typer.Exit(code=1) from None
            raise
    except OSError as e:  # a full, read-only or forbidden disk is the machine's state: one line, not a traceback
        if e.errno not in WRITE_ERRORS:
            raise
        raise UserError(write_error(e)) from None
