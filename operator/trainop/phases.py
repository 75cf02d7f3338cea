"""Phases more than one module judges. A DistributedTrainingJob and a Pod end the same way:
`Succeeded` or `Failed` are final (nothing runs, nothing is created again); the copy Job of a
DataStage reports through conditions instead (stagesync)."""

TERMINAL = ("Succeeded", "Failed")


def finished(obj: dict) -> bool:
    """The object's status.phase is final (a job or a pod)."""
    return (obj.get("status") or {}).get("phase") in TERMINAL
