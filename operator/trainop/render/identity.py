"""The identities the operator hands to its own helper pods (the DataStage stager, the job's log
shipper): a ServiceAccount, a Role of a few named rules, and the RoleBinding between them. One
renderer for both, so they cannot drift apart. Pure: no I/O.

    objs = identity.objects("j1-logship", "team-a", labels, [
        identity.rule("", "configmaps", "j1-progress", ["get", "patch"])])

Every rule names its objects (resourceNames): a helper may touch only the one object it reports
to. The API server lets the operator create such a Role only while it holds each verb itself
(escalation check), so charts/trainop/templates/rbac.yaml must list every verb used here;
docs/security.md tables them.
"""

from __future__ import annotations

from trainop.render import common

RBAC = "rbac.authorization.k8s.io"


def rule(group: str, resource: str, name: str, verbs: list[str]) -> dict:
    """`verbs` on the one object `name` of `resource` (a subresource as "kind/sub")."""
    return {"apiGroups": [group], "resources": [resource], "resourceNames": [name],
            "verbs": list(verbs)}


def objects(name: str, namespace: str, labels: dict[str, str], rules: list[dict],
            account: str | None = None, automount: bool | None = None) -> list[dict]:
    """Role and RoleBinding `name` granting `rules` to ServiceAccount `account` in `namespace`;
    the ServiceAccount itself too when `account` is None or `name` (ours), never when it names
    another (a user's workload-identity ServiceAccount, which the user owns). `automount`, when
    not None, sets the ServiceAccount's automountServiceAccountToken: False where only one
    container of the pod may hold the token (projected into it, render/logship.py)."""
    account = account or name
    out = []
    if account == name:
        sa = {"apiVersion": "v1", "kind": "ServiceAccount",
              "metadata": common.metadata(name, namespace, labels)}
        if automount is not None:
            sa["automountServiceAccountToken"] = automount
        out.append(sa)
    out.append({"apiVersion": f"{RBAC}/v1", "kind": "Role",
                "metadata": common.metadata(name, namespace, labels), "rules": list(rules)})
    out.append({"apiVersion": f"{RBAC}/v1", "kind": "RoleBinding",
                "metadata": common.metadata(name, namespace, labels),
                "roleRef": {"apiGroup": RBAC, "kind": "Role", "name": name},
                "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]})
    return out
