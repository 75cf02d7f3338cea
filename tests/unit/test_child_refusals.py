"""Issue 22, L4: a child the API server refuses for what it is fails the job (ChildRejected),
so the gate frees its quota, instead of being retried forever while the job holds admission:
400 and admission 403s as well as 422, and Pod Security refusing what a pod template added.
What an admin fixes (the operator's RBAC, Pod Security refusing what the operator's own
configuration adds) and what frees itself (an exceeded ResourceQuota) are still waited on."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.exceptions import ApiException

from tests.unit.test_jobsync_decide import CFG, CREATED, NOW, body, reasons, snap
from trainop import apply
from trainop.actions import Problem
from trainop.jobsync import decide


def refusal(status: int, message: str) -> ApiException:
    exc = ApiException(status=status, reason="x")
    exc.body = json.dumps({"kind": "Status", "message": message})
    return exc


@pytest.mark.parametrize("status, message, fails", [
    (422, 'Pod "j-worker-0" is invalid: spec.containers[0].name: Duplicate value', True),
    (400, 'admission webhook "policy.example.com" denied the request: no latest tags', True),
    (403, 'pods "j-worker-0" is forbidden: maximum cpu usage per Container is 2, but limit is 4', True),
    (403, "ValidatingAdmissionPolicy 'no-sidecars' with binding 'b' denied request: no", True),
    (403, 'pods "j-worker-0" is forbidden: exceeded quota: compute, requested: cpu=8', False),
    (403, 'pods is forbidden: User "system:serviceaccount:trainop:trainop" cannot create '
          'resource "pods" in API group "" in the namespace "ns"', False),
    (409, "already exists", False),
    (500, "etcd timeout", False),
])
def test_what_a_refusal_means(status, message, fails):
    assert apply.rejected(refusal(status, message)) is fails


POD_SECURITY = ('pods "j-worker-0" is forbidden: violates PodSecurity "restricted:latest": '
                'allowPrivilegeEscalation != false (container "debug" must set ...)')


def test_pod_security_fails_a_job_whose_template_it_refuses_and_waits_for_the_operators_own():
    problem = Problem("PodSecurity", "the namespace's Pod Security admission refused ...", POD_SECURITY)
    templated = decide(snap(body({"phase": "Starting", "conditions": CREATED},
                                 podTemplate={"worker": {"metadata": {"labels": {"a": "b"}}}}),
                            problem=problem), CFG, NOW)
    assert templated.status["phase"] == "Failed"
    assert reasons(templated.status)["Failed"] == ("True", "ChildRejected")
    message = next(c["message"] for c in templated.status["conditions"] if c["type"] == "Failed")
    assert message.startswith("spec.podTemplate: ") and 'container "debug"' in message
    own = decide(snap(body({"phase": "Starting", "conditions": CREATED}), problem=problem), CFG, NOW)
    assert own.status["phase"] == "Pending"
    assert reasons(own.status)["Created"] == ("False", "PodSecurityForbidden")
