"""Memory facts: probes (host, cgroup, PSI, GPU), per-process accounting, budget, monitor."""
