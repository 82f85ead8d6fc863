"""HTTP routes: translate HTTP <-> service calls, nothing else."""
