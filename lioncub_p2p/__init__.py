"""lioncub-p2p: decentralized training with bit-packed Lion sign votes over a hivemind DHT."""
from .optim import Aggregator, LionCub
from .momentum import MomentumSchedule

__all__ = ["LionCub", "Aggregator", "MomentumSchedule"]
__version__ = "0.1.0"
