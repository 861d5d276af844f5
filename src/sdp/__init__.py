"""Subnetwork Data Parallelism (arXiv 2507.09029): an experiment framework."""
