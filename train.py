"""`python train.py --config R [--section.key value ...]` is `titan train --config R ...`."""

import sys

from titan.cli import main

if __name__ == "__main__":
    sys.argv.insert(1, "train")
    main()
