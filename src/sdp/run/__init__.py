"""A training run, from a typed config to summary.json: `runner` (the process group's lifetime,
resume, signals, export), `build` (the model under its strategy), `trainer` (the loop and the step),
`checkpoint`, `measure` (timers, peaks and FLOPs without host syncs), `nonfinite` (a NaN/Inf step
is never applied) and `baselines` (dropout and stochastic depth at SDP's keep rate)."""
