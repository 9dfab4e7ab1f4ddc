"""Simulators of clusters larger than this machine: stragglers and packing."""
