"""render/datastage.py with `destination.volumeClaim`: the user's existing claim (Azure Files,
Azure NetApp Files...) instead of NFS: no PV or claim of ours, the copy Job writes into it."""

from __future__ import annotations

import pytest

from tests.unit.test_render_datastage import CFG, body
from trainop import crds
from trainop.render import datastage as render
from trainop.spec import SpecError, parse_stage

CLAIM = {"volumeClaim": {"claimName": "shared-files"}}


def test_existing_claim_is_used_as_it_is():
    stage = parse_stage(body(CLAIM))
    assert (stage.existing_claim, stage.provisioned, stage.nfs_server) == ("shared-files", False, None)
    assert render.claim_name(stage) == "shared-files"
    assert render.volume_objects(stage, None) == []
    assert render.server_objects(stage, CFG) == []
    pod = render.copy_job(stage, None, CFG)["spec"]["template"]["spec"]
    assert pod["volumes"] == [{"name": "share", "persistentVolumeClaim": {"claimName": "shared-files"}}]
    assert crds.validate(crds.default(body(CLAIM))) == []


@pytest.mark.parametrize("destination", [
    {"volumeClaim": {"claimName": "x"}, "nfs": {"server": "10.1.2.3", "path": "/e"}},
    {"volumeClaim": {"claimName": "x"}, "provision": {"size": "1Ti"}},
])
def test_two_destinations_are_refused_naming_the_field(destination):
    with pytest.raises(SpecError, match=r"spec\.destination: set exactly one of nfs .* or volumeClaim"):
        parse_stage(body(destination))
