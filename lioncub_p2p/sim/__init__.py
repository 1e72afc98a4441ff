"""The researcher's tools: swarms of local peers as processes on shaped links (lioncub-sim), several
hosts in network namespaces with NAT and latency, in-process comparisons of vote encodings
(lioncub-compare), soak, process faults and the reliability suite (lioncub-reliability)."""
