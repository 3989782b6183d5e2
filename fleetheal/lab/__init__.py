"""The local lab: real daemons (Slurm, Prometheus, Alertmanager) on one machine for tests and demos."""
