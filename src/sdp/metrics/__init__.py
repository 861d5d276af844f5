"""Per-rank measurements: memory bytes, communication bytes, run outputs."""
