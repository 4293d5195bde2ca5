"""Operating it: Prometheus metrics, JSON logs, the `sluicegate status` table."""
