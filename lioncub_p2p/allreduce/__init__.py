"""One vote round: partition into parts, voter side, reducer side, round report."""
from .node import FETCH_PROTOCOL, VOTE_PROTOCOL, VoteNode, assemble
from .partition import PeerSpec, part_bounds
from .round import AllReduceConfig, PartReport, RoundReport, RoundSpec

__all__ = ["VoteNode", "assemble", "PeerSpec", "part_bounds", "AllReduceConfig", "RoundSpec", "RoundReport",
           "PartReport", "VOTE_PROTOCOL", "FETCH_PROTOCOL"]
