"""What joining a run stops with: one line a volunteer can act on."""


class SwarmError(RuntimeError):
    """Something a volunteer has to act on (unreachable coordinators, version mismatch, ...); one line."""


class AdmissionRefused(SwarmError):
    """The run's group refused this peer (wrong or missing run secret, not on the allow-list)."""


class SettingsMismatch(SwarmError):
    """This peer's settings or model differ from the run's manifest."""
