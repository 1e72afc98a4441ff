"""Console entry points for volunteers and coordinators: lioncub-train (with --preflight),
lioncub-coordinator, lioncub-monitor and lioncub-plot. They run on the core install and never import
the simulator; the simulator's entry points (lioncub-sim, lioncub-compare, lioncub-reliability) live
in ``lioncub_p2p.sim``."""
