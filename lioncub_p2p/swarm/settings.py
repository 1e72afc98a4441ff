"""A peer's settings for a run: its own opinions, the run's manifest, and what it runs with.

A peer's config gives opinions (a value given) and leaves the rest open (None); the run's manifest,
published by its founder or a coordinator, fills them in. ``RunSettings`` resolves the two: when the
peer starts, with the manifest as read (``adopt``), and at ``Swarm.join`` once more with what the
optimizer says (the model's layout, its lr, weight decay, betas: ``settle``), where a founder's
settings become the run's. A difference stops the peer with one line naming the field
(``SettingsMismatch``; ``AdmissionRefused`` for the run secret).

Owned by the training thread; ``Upkeep`` reads ``run`` through ``upkeep.Local`` (replaced whole,
never mutated).
"""
from __future__ import annotations

from ..optim import LionCub
from . import manifest as manifests, snapshot
from .errors import AdmissionRefused, SettingsMismatch, SwarmError
from .manifest import DEFAULTS, Manifest, ManifestError, ManifestMismatch


class RunSettings:
    def __init__(self, run_id: str, opinions: Manifest, peer_id: str = ""):
        self.run_id, self.opinions, self.peer_id = run_id, opinions, peer_id
        self.run: Manifest | None = None  # the run's, as published by its leader (or a coordinator)
        self.current = opinions.merged(DEFAULTS)  # this peer's settings (the run's, adopted)

    def adopt(self, run: Manifest | None) -> None:
        """Take the run's manifest as read from the DHT (None: none published yet)."""
        if run is None:
            return
        if run.authority is not None and self.opinions.authority is None:
            raise AdmissionRefused(f"run {self.run_id} is invited-only: ask its organizer for a ticket for peer id "
                                   f"{self.peer_id or '(lioncub-invite id prints it)'} (they run lioncub-invite issue "
                                   f"--peer ...), then pass it with --ticket FILE and the same --identity-path")
        try:
            self.current = manifests.resolve(self.opinions, run, self.run_id).merged(DEFAULTS)
        except ManifestMismatch as e:
            raise self._mismatch(e, run) from None
        self.run = run

    def settle(self, optimizer: LionCub, applied: Manifest, *, founding: bool) -> None:
        """Add what the optimizer says (layout, lr, ...) to this peer's opinions and check them against
        the run's manifest and the swarm settings the peer already ``applied``; ``founding``: this
        peer starts the run, and its settings become the run's."""
        own = self.opinions.merged(self._from_optimizer(optimizer))
        run = self.run
        try:
            settled = manifests.resolve(own, run, self.run_id).merged(DEFAULTS)
        except ManifestMismatch as e:
            if run is not None and run.layout_hash not in (None, own.layout_hash):
                raise SettingsMismatch(f"this peer's model differs from run {self.run_id}'s ({own.param_count} "
                                       f"parameters, layout {own.layout_hash[:8]}; the run: {_size(run)}): "
                                       f"{_model_hint(run)}") from None
            raise self._mismatch(e, run) from None
        changed = [name for name in manifests.SWARM_FIELDS if getattr(applied, name) != getattr(settled, name)]
        if changed:
            raise SettingsMismatch(f"run {self.run_id}'s manifest appeared after this Swarm was created and "
                                   f"sets {', '.join(changed)} otherwise: create the Swarm again to adopt it")
        self.current = settled
        if founding:
            self.run = settled

    def _from_optimizer(self, optimizer: LionCub) -> Manifest:
        """The optimizer's layout, and its lr, weight decay and betas where every param group shares one."""
        layout = snapshot.Layout.of(optimizer)
        found = {"layout_hash": layout.digest(), "param_count": layout.param_count()}
        for key in ("lr", "weight_decay", "betas"):
            values = {tuple(g[key]) if key == "betas" else g[key] for g in optimizer.param_groups}
            if len(values) == 1:  # one value for every group: part of the run's settings
                found[key] = values.pop()
        try:
            from_optimizer = Manifest(**found)
        except ManifestError:  # e.g. an lr beyond what a manifest holds: compare the layout only
            from_optimizer = Manifest(layout_hash=found["layout_hash"], param_count=found["param_count"])
        clash = from_optimizer.conflicts(self.opinions)
        if clash:
            name, mine, theirs = clash[0]
            raise SettingsMismatch(f"the optimizer's {name}={mine} differs from this peer's setting {name}={theirs}")
        return from_optimizer

    def _mismatch(self, error: ManifestMismatch, run: Manifest) -> SwarmError:
        if run.authority is not None and self.opinions.authority not in (None, run.authority):
            return AdmissionRefused(f"this peer's ticket is signed by {self.opinions.authority}, but run {self.run_id} "
                                    f"admits tickets of {run.authority}: ask its organizer for one")
        if run.authority is None and self.opinions.authority is not None:
            return AdmissionRefused(f"run {self.run_id} asks for no ticket (not an invited run): check --run-id, or "
                                    f"drop --ticket")
        if run.secret_required is not None and run.secret_required != self.opinions.secret_required:
            if run.secret_required:
                return AdmissionRefused(f"run {self.run_id} is private: pass its --run-secret")
            return AdmissionRefused(f"run {self.run_id} is open (no run secret): drop --run-secret")
        return SettingsMismatch(str(error))


def _size(run: Manifest) -> str:
    counted = f"{run.param_count} parameters, " if run.param_count is not None else ""
    return f"{counted}layout {run.layout_hash[:8]}"


def _model_hint(run: Manifest) -> str:
    """How to build the run's model, from what its manifest says."""
    if run.task is not None:
        args = "".join(f", {key} {value}" for key, value in sorted((run.task_args or {}).items()))
        return f"build the run's model (task {run.task}{args})"
    of = f" of {run.param_count} parameters" if run.param_count is not None else ""
    return (f"build the run's model{of} (its manifest names no task: ask the run's organizer which --task and "
            f"--hidden make it)")
