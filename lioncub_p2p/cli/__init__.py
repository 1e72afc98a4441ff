"""Console entry points: lioncub-coordinator, lioncub-monitor, lioncub-train, lioncub-compare, lioncub-sim."""
