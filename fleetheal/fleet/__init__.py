"""Many clusters, one pool: what fleetheal adds to a Slurm federation.

`config` reads the fleet file (the clusters, the data catalogue, the queue policy, the checkpoint stores);
`placement` chooses a cluster for a job (`fleetheal submit`; the decision itself in `placement_policy`);
`queues` lends idle capacity between the large-job and small-job queues and replays job traces
(`fleetheal queue replay|lend`; the policy and the simulator in `queue_policy`); `status` shows the fleet
(`fleetheal fleet status|exporter`: the view read by `view`, shown by `render`); `failover` moves a job to
another cluster. Slurm's federation does the rest: users keep `sbatch`.
"""
