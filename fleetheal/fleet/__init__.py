"""Many clusters, one pool: what fleetheal adds to a Slurm federation.

`config` reads the fleet file (the clusters, the data catalogue, the queue policy, the checkpoint stores);
`placement` chooses a cluster for a job (`fleetheal submit`); `queues` lends idle capacity between the
large-job and small-job queues and replays job traces (`fleetheal queue replay`); `status` shows the
fleet (`fleetheal fleet status`). Slurm's federation does the rest: users keep `sbatch`.
"""
