"""Recovery from failures: whose shared-memory folder the in-memory snapshots live in (snapshot_folder) and when
to take them (interval)."""
