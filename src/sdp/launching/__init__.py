"""Starting runs: `cli` (the Hydra command line: overrides, --help, --cfg), `torchrun` (the
entrypoint as its own launcher), `sweep` (`-m`: one run per point of a grid, locally or on SLURM)
and `variants` (several variants of one config, compared: make run and make bench)."""
