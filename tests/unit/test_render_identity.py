"""render/identity.py: the one renderer of the helper identities (stager, log shipper)."""

from __future__ import annotations

from trainop import config, spec
from trainop.render import datastage, identity, logship
from trainop.render.identity import objects, rule
from trainop.spec import parse_stage

LABELS = {"trainop.io/job-name": "j1"}
RULE = rule("", "configmaps", "j1-progress", ["patch"])


def test_rule_names_its_one_object():
    assert RULE == {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["j1-progress"],
                    "verbs": ["patch"]}


def test_own_account_role_and_binding():
    sa, role, binding = objects("j1-logship", "team-a", LABELS, [RULE], automount=False)
    meta = {"name": "j1-logship", "namespace": "team-a", "labels": LABELS}
    assert sa == {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta,
                  "automountServiceAccountToken": False}
    assert role == {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
                    "rules": [RULE]}
    assert binding == {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
                       "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "j1-logship"},
                       "subjects": [{"kind": "ServiceAccount", "name": "j1-logship", "namespace": "team-a"}]}
    # automount left to the cluster's default when not asked
    assert "automountServiceAccountToken" not in objects("s", "ns", {}, [RULE])[0]
    assert objects("s", "ns", {}, [RULE], account="s")[0]["kind"] == "ServiceAccount"


def test_someone_elses_account_is_bound_not_created():
    objs = objects("j1-logship", "team-a", LABELS, [RULE], account="team-wi", automount=False)
    assert [o["kind"] for o in objs] == ["Role", "RoleBinding"]
    assert objs[1]["subjects"] == [{"kind": "ServiceAccount", "name": "team-wi", "namespace": "team-a"}]


def test_stager_and_shipper_both_come_from_here():
    """Same shape for both helpers (the only differences: the rule and the token policy)."""
    stage = parse_stage({"apiVersion": "trainop.io/v1alpha1", "kind": "DataStage", "metadata": {"name": "data", "namespace": "team-a"}, "spec": {
        "source": {"blob": {"accountURL": "https://a.blob.core.windows.net", "container": "results",
                            "auth": {"sasSecretRef": {"name": "s", "key": "sas"}}}},
        "destination": {"volumeClaim": {"claimName": "mine"}}}})
    assert datastage.rbac_objects(stage) == identity.objects(
        "data-stager", "team-a", {"trainop.io/datastage": "data", "trainop.io/role": "copy"},
        [rule("", "configmaps", "data-progress", ["patch"])])
    j = spec.parse({"metadata": {"name": "j1", "namespace": "team-a"}, "spec": {"workers": 1, "output": {"blob": {
        "accountURL": "https://a.blob.core.windows.net", "container": "results",
        "auth": {"sasSecretRef": {"name": "s", "key": "sas"}}}}}}, config.from_dict(None))
    assert logship.rbac(j, {}) == objects("j1-logship", "team-a", LABELS, [RULE], automount=False)
