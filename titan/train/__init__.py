"""The training core: the trainer loop and the straggler re-plan."""
