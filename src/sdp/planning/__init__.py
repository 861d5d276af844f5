"""Before a launch, without a GPU: `estimator` (a rank's memory, traced under fake tensors) and
`step_time` (a step's time on a described cluster: compute, collectives, what overlaps)."""
