"""The container suite uses the root fixtures (workspace, slurm_cluster)."""
