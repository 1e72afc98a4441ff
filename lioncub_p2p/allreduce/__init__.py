"""One vote round: partition into parts, voter side, reducer side, audits, round report."""
from .assembly import assemble
from .audit import check_evidence
from .node import VoteNode
from .partition import PeerSpec, part_bounds, quorum
from .round import AllReduceConfig, Caught, PartReport, RoundReport, RoundSpec
from .shared import AUDIT_PROTOCOL, FETCH_PROTOCOL, VOTE_PROTOCOL

__all__ = ["VoteNode", "assemble", "PeerSpec", "part_bounds", "quorum", "AllReduceConfig", "RoundSpec", "RoundReport",
           "PartReport", "Caught", "check_evidence", "VOTE_PROTOCOL", "FETCH_PROTOCOL", "AUDIT_PROTOCOL"]
