"""Reading finished run dirs: `tables` (the paper's tables and plots), `claims` (the paper's claims
judged against them) and `rho` (the spectral gap against convergence). Nothing here starts a run."""
