"""Memory facts: probes (host, cgroup, PSI, GPU), per-process accounting, the budget, the monitor."""
