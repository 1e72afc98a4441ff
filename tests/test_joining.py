"""Joining.find_or_found without a network: a run with no group is founded with this peer's settled
manifest; a peer that loses a founding race (another peer's group wins, ``RunFinder.found``) reads
the run again and adopts the winner's manifest. The DHT path: tests/test_swarm.py, test_manifest.py."""
from types import SimpleNamespace

from lioncub_p2p.allreduce import PeerSpec
from lioncub_p2p.swarm.joining import Joining
from lioncub_p2p.swarm.manifest import Manifest
from lioncub_p2p.swarm.membership import GroupRecord
from lioncub_p2p.swarm.settings import RunSettings
from test_settings import _applied, _optimizer


class Finder:
    """The parts of RunFinder that find_or_found uses; ``rival``: the group and manifest of a peer that
    founds the run at the same moment and keeps it."""

    def __init__(self, upkeep, rival: tuple[GroupRecord, Manifest] | None = None):
        self.upkeep, self.rival, self.unreachable = upkeep, rival, False
        self.published: Manifest | None = None
        self.founded_with: list[tuple[GroupRecord, Manifest]] = []

    def find_group(self) -> None:
        pass

    def read_manifest(self) -> Manifest | None:
        return self.published

    def found(self, record: GroupRecord, manifest: Manifest) -> bool:
        self.founded_with.append((record, manifest))
        if self.rival is None:
            self.upkeep.history.latest, self.published = record, manifest
            return True
        self.upkeep.history.latest, self.published = self.rival  # the smaller peer id keeps its group
        return False


def _joining(finder_rival=None) -> tuple[Joining, Finder]:
    upkeep = SimpleNamespace(history=SimpleNamespace(latest=None))
    finder = Finder(upkeep, finder_rival)
    joining = Joining(run_id="run", peer_id="me", client_mode=False, refresh_period=0.1, loop=None, finder=finder,
                      settings=RunSettings("run", Manifest()), upkeep=upkeep, state=None, directory=None,
                      my_spec=lambda: PeerSpec("me", 1.0, False))
    return joining, finder


def test_a_run_with_no_group_is_founded_with_this_peers_settled_manifest():
    joining, finder = _joining()
    assert joining.find_or_found(_optimizer(), _applied(joining.settings), deadline=0.0)
    (record, manifest), = finder.founded_with
    assert record.member_ids() == ["me"] and record.author == "me" and record.from_step == 0
    assert manifest is joining.settings.run and manifest.lr == 1e-3 and manifest.layout_hash


def test_a_peer_that_loses_a_founding_race_adopts_the_winners_manifest():
    rival = RunSettings("run", Manifest())
    rival.settle(_optimizer(lr=2e-3), _applied(rival), founding=True)  # another lr: the winner's is the run's
    group = GroupRecord(0, 0, (PeerSpec("a-rival", 1.0, False),), author="a-rival")
    joining, finder = _joining((group, rival.run))
    try:
        joining.find_or_found(_optimizer(), _applied(joining.settings), deadline=0.0)
    except Exception as e:  # this peer's optimizer has lr 1e-3: it stops with one line naming the field
        assert "lr" in str(e), e
    else:
        raise AssertionError("a peer whose lr differs from the run's founder went on")
    assert joining.settings.run is rival.run  # it read the run again and took the winner's manifest

    joining, finder = _joining((group, rival.run))
    assert not joining.find_or_found(_optimizer(lr=2e-3), _applied(joining.settings), deadline=0.0)
    assert joining.settings.run is rival.run and joining.settings.current.digest() == rival.run.digest()
    assert len(finder.founded_with) == 1  # it tried once, lost, and joined the winner's run
