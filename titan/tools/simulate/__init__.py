"""Simulators of clusters larger than this machine: stragglers, packing and failures."""
