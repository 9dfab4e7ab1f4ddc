"""The commands besides train: plan, verify, compare, generate, simulate."""
