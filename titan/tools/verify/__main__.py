"""The entry point of a recorded run's processes: `python -m titan.tools.verify --config <recipe> --steps <n>` (or
`--until <step>` for a replay), which `titan verify` starts (runs.py, replay.py)."""

import argparse
import sys

from titan.config import load_config
from titan.errors import UserError
from titan.tools.verify.recording import record, replay_run


def main() -> None:
    """The recording entry point each run's processes start with (titan verify launches them)."""
    parser = argparse.ArgumentParser(prog="python -m titan.tools.verify")
    parser.add_argument("--config", required=True)
    to = parser.add_mutually_exclusive_group(required=True)
    to.add_argument("--steps", type=int, help="record this many steps from the start")
    to.add_argument("--until", type=int, help="a replay: train from the recipe's checkpoint to this step")
    args = parser.parse_args()
    try:
        if args.steps is not None:
            record(load_config(args.config), args.steps)
        else:
            replay_run(load_config(args.config), args.until)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
