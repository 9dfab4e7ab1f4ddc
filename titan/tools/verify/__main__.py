"""The entry point of a recorded run's processes: `python -m titan.tools.verify --config <recipe> --steps <n>`,
which `titan verify` starts (runs.py)."""

import argparse
import sys

from titan.config import load_config
from titan.errors import UserError
from titan.tools.verify.recording import record


def main() -> None:
    """The recording entry point each run's processes start with (titan verify launches them)."""
    parser = argparse.ArgumentParser(prog="python -m titan.tools.verify")
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args()
    try:
        record(load_config(args.config), args.steps)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
