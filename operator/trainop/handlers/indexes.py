"""kopf's watch caches: the custom resources and the kinds a reconcile reads that are not the
operator's own watches' (pods and a job's launcher Job, Services, ConfigMaps and NetworkPolicy:
handlers/caches.py, informer.py says why), and the routing that wakes the owner of whatever
changed (mpi-operator's handleObject). kopf fills every index from its initial listing before
any other handler runs, and updates an index before the change handlers of the same event run,
so a woken reconcile sees the change that woke it. (The controller takes nothing from its
queue before the own watches' first lists are in either.)

Values are slimmed to the fields the decisions read (a node its labels and allocatable, a
Workload what admission compares): a few hundred jobs' objects and nodes fit in tens of MB.

    index                key                      value
    dtj_bodies           (ns, name)               the DistributedTrainingJob
    dtj_admission        (ns, job-name, kind)     its Kueue Workload ("Workload": conditions,
                                                  admission, the pod sets' counts and resources;
                                                  none without Kueue), its PodGroup (POD_GROUPS:
                                                  the kind with the scheduler's API group;
                                                  runPolicy.schedulingPolicy; none where that
                                                  scheduler's API is not served)
    nodes                (NODE_POOL, agentpool)   nodes (labels, allocatable)
                         (NODE_TAINTED,)          the names of the nodes that carry the preflight's taint
                         (NODE_LOST,)             the nodes whose Ready condition is Unknown (the node
                                                  lifecycle controller's verdict: the kubelet went silent),
                                                  {name, since, message, fenced: its unreachable
                                                  NoSchedule taint is on}
                         (NODE_ADDRESS, name)     its InternalIP (where its kubelet mounts NFS from)
    quotas               ns                       ResourceQuotas
    stage_bodies         (ns, name)               DataStages
    stage_children       (ns, stage, kind)        a DataStage's Service, StatefulSet and copy Jobs
    references           (kind, ns, name)         every ServiceAccount's name (workload identity) and
                                                  PersistentVolumeClaim's name (volumeClaim)
    scheduling           (kind, name)             PriorityClasses (value, globalDefault), Kueue's
                                                  WorkloadPriorityClasses (value) and ResourceFlavors
                                                  (nodeLabels, tolerations: what an admitted pod
                                                  set's pods get); none of Kueue's without Kueue

Few indexes, each fed by one function for several kinds: kopf builds every handler's kwargs
with each index in them, so fewer indexes cost less per watch event (issue 30).

Watched without an index (decide() applies them without reading them; a change or a deletion
makes the apply layer forget them and wakes the owner, which applies them again:
`route_job_applied`, `route_stage_applied`): the helper identities' ServiceAccount, Role and
RoleBinding (render/identity.py) of jobs and DataStages, a DataStage's NetworkPolicy and claim.

Not watched: Secrets (the operator would hold every credential of the namespaces it serves;
see apply.py and stagesync.py for how it does without: the SSH Secret is read by name at the
safety resync); a DataStage's PersistentVolume (cluster-scoped: read by name at each of its
reconciles, so the safety resync puts back a deleted one); EndpointSlices (the launcher
reaches the workers by their pod IPs, its hostAliases: nothing waits for cluster DNS, and the
slices' updates, about three per job, were a sixth of the watch events of a new job).
"""

from __future__ import annotations

import logging

import kopf

from trainop import GROUP, VERSION, metrics, phases
from trainop.config import POOL_LABEL
from trainop.jobsync.failures import node_lost
from trainop.kueue import ELASTIC_ANNOTATION, REPLACES_ANNOTATION
from trainop.kueue import GROUP as KUEUE_GROUP
from trainop.kueue import VERSION as KUEUE_VERSION
from trainop.render import common
from trainop.render import datastage as render_stage
from trainop.render import podgroup as render_podgroup
from trainop.render.fabric import UNHEALTHY_TAINT
from trainop.spec import bounded

LABEL_JOB = common.LABEL_JOB
JOB_KIND, STAGE_KIND = "DistributedTrainingJob", "DataStage"  # controller.py's key kinds
LABEL_STAGE = render_stage.LABEL_STAGE
_HAS_JOB = {LABEL_JOB: kopf.PRESENT}
_HAS_STAGE = {LABEL_STAGE: kopf.PRESENT}


def _quiet(record: logging.LogRecord) -> bool:
    """kopf logs every handler's success at INFO: for indexes and routers that is a line per
    watch event of every object, which says nothing; failures are still logged."""
    msg = record.getMessage()
    return not (msg.startswith("Handler 'route_") or msg.startswith("Indexing handler")) \
        or "succeeded" not in msg


def _group_version(api_version: str) -> tuple[str, str]:
    group, _, version = api_version.partition("/")
    return group, version


PLUGINS_API = _group_version(render_podgroup.API_VERSION[render_podgroup.PLUGINS])
VOLCANO_API = _group_version(render_podgroup.API_VERSION[render_podgroup.VOLCANO])
# APIs the operator watches where they are served and does without where they are not.
OPTIONAL_GROUPS = (KUEUE_GROUP, PLUGINS_API[0], VOLCANO_API[0])


def _optional_apis(record: logging.LogRecord) -> bool:
    """kopf warns once that it cannot watch Kueue's kinds or a gang scheduler's PodGroups when
    their APIs are not installed; that is a supported set-up (jobs are admitted natively, pods
    use the default scheduler), not something to fix. A warning that names any other kind
    still shows."""
    msg = record.getMessage()
    unresolved = msg.partition("): ")[2]  # "Selector(group='...', ...), Selector(...)"
    selectors = unresolved.split("Selector(")[1:]
    return not (msg.startswith("Unresolved resources") and selectors
                and all(any(f"group='{g}'" in s for g in OPTIONAL_GROUPS) for s in selectors))


logging.getLogger("kopf.objects").addFilter(_quiet)
logging.getLogger("kopf._core.reactor.observation").addFilter(_optional_apis)


def configure(settings: kopf.OperatorSettings) -> None:
    """Server-side label selectors: the API server sends kopf only the objects of the kinds it
    watches that carry the label of their owners' kind here. (A job's launcher Job, Services,
    ConfigMaps and NetworkPolicy come on the operator's own watches, handlers/caches.py, with
    the job label as their selector; pods, also there, have none: a job's, a DataStage's
    server and its readers are any pod labelled so, and a selector cannot say "this label or
    that one".)"""
    for resource in (("v1", "services"), ("batch", "v1", "jobs"), ("apps", "v1", "statefulsets"),
                     ("networking.k8s.io", "v1", "networkpolicies")):
        settings.watching.label_selectors[resource] = LABEL_STAGE
    settings.watching.label_selectors[KUEUE_GROUP, KUEUE_VERSION, "workloads"] = LABEL_JOB


# ---- slimming ---------------------------------------------------------------------------

def _meta(body) -> dict:
    m = body["metadata"]
    out = {"name": m["name"], "namespace": m.get("namespace"), "uid": m.get("uid"),
           "resourceVersion": m.get("resourceVersion"), "labels": dict(m.get("labels") or {}),
           "creationTimestamp": m.get("creationTimestamp")}
    for key in ("deletionTimestamp", "ownerReferences", "generation"):
        if m.get(key) is not None:
            out[key] = m[key]
    return out


def slim_obj(body, **parts) -> dict:
    return {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
            "metadata": _meta(body), **parts}


# ---- DistributedTrainingJobs and their children ---------------------------------------------

def _job_key(body, namespace) -> tuple:
    return namespace, body["metadata"]["labels"][LABEL_JOB]


def slim_owner(body) -> dict:
    """A DistributedTrainingJob or DataStage as the caches keep it: without managedFields and
    annotations, which the operator never reads (together they can be larger than the spec),
    and with a spec (and labels) above spec.MAX_SPEC_BYTES kept as its size (parsing then fails
    it naming spec): one namespace cannot fill the shared operator's memory with large objects
    (M7)."""
    meta = {k: v for k, v in body["metadata"].items() if k not in ("managedFields", "annotations")}
    return bounded({**dict(body), "metadata": meta})


@kopf.index(GROUP, VERSION, "distributedtrainingjobs")
async def dtj_bodies(body, name, namespace, **_):
    return {(namespace, name): slim_owner(body)}


def slim_workload(body) -> dict:
    st = body.get("status") or {}
    admission = st.get("admission") or {}
    status: dict = {"conditions": [dict(c) for c in st.get("conditions") or []]}
    if admission:
        status["admission"] = {"clusterQueue": admission.get("clusterQueue"), "podSetAssignments": [
            {"name": a.get("name"), "flavors": dict(a.get("flavors") or {})}
            for a in admission.get("podSetAssignments") or []]}
    # What kueue.mismatch compares (admission.shape): each pod set's name, count and its
    # containers' names and resources; the rest of the templates stays out of memory.
    pod_sets = [{"name": ps.get("name"), "count": ps.get("count"), "template": {"spec": {
        group: [{"name": c.get("name"), "resources": c.get("resources") or {}}
                for c in ((ps.get("template") or {}).get("spec") or {}).get(group) or []]
        for group in ("initContainers", "containers")}}}
        for ps in (body.get("spec") or {}).get("podSets") or []]
    out = slim_obj(body, spec={"podSets": pod_sets}, status=status)
    # Kueue's workload-slice marks (kueue.pick): which Workload replaces which
    notes = {k: v for k, v in (body["metadata"].get("annotations") or {}).items()
             if k in (ELASTIC_ANNOTATION, REPLACES_ANNOTATION)}
    if notes:
        out["metadata"]["annotations"] = notes
    return out


def _child_kind(body) -> str:
    """The last part of a dtj_admission key: the child's kind; a PodGroup's with its API group
    (the scheduler-plugins' and Volcano's share the kind)."""
    kind = body.get("kind")
    return f"{kind}.{_group_version(body.get('apiVersion') or '')[0]}" if kind == "PodGroup" else kind


# a PodGroup's _child_kind, the scheduler-plugins' first (the order the controller looks in)
POD_GROUPS = tuple(f"PodGroup.{api[0]}" for api in (PLUGINS_API, VOLCANO_API))


# A job's Kueue Workload and its PodGroup (what admits it and gangs its pods): the kinds whose
# APIs may not be served, which kopf watches where they are and does without where they are not
# (its other children are the operator's own watch's: handlers/caches.py). One index for all
# three: kopf builds every handler's kwargs with each index in them (issue 30).
@kopf.index(KUEUE_GROUP, KUEUE_VERSION, "workloads", labels=_HAS_JOB)
@kopf.index(*PLUGINS_API, "podgroups", labels=_HAS_JOB)
@kopf.index(*VOLCANO_API, "podgroups", labels=_HAS_JOB)
async def dtj_admission(body, namespace, **_):
    slim = slim_workload(body) if body.get("kind") == "Workload" else slim_obj(body)
    return {(*_job_key(body, namespace), _child_kind(body)): slim}


# ---- cluster state the gate and placement read ----------------------------------------------

# One handler for the three views of a node: kopf builds every handler's arguments afresh on
# every watch event, and a cluster's nodes change often (a new 500-node cluster's controller-
# manager patched each about once a minute for two minutes; three handlers plus the router cost
# twice what this one does).
NODE_POOL, NODE_TAINTED, NODE_LOST, NODE_ADDRESS = "pool", "tainted", "lost", "address"  # the keys' first parts
# The node lifecycle controller's taints that keep the scheduler off a node it judged lost.
FENCING_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")


@kopf.index("v1", "nodes")
async def nodes(body, **_):
    """A node under (NODE_POOL, its agentpool label): its labels and allocatable; its name
    under (NODE_TAINTED,) when it carries the preflight's taint (preflight.maxTaintedNodes is
    counted from them in decide; apply's TaintNode counts again from the API, against a race);
    under (NODE_LOST,) while it is judged lost; its InternalIP under (NODE_ADDRESS, name)."""
    meta, labels = body["metadata"], dict(body["metadata"].get("labels") or {})
    # keys a node no longer has leave the index (kopf drops an object's keys not returned)
    out = {(NODE_POOL, labels.get(POOL_LABEL, "")): {
        "metadata": {"name": meta["name"], "labels": labels},
        "status": {"allocatable": dict((body.get("status") or {}).get("allocatable") or {})}}}
    if any(t.get("key") == UNHEALTHY_TAINT for t in (body.get("spec") or {}).get("taints") or []):
        out[(NODE_TAINTED,)] = meta["name"]
    address = next((a.get("address") for a in (body.get("status") or {}).get("addresses") or []
                    if a.get("type") == "InternalIP"), None)
    if address:
        out[(NODE_ADDRESS, meta["name"])] = address
    ready = node_lost(body)
    if ready is not None:
        out[(NODE_LOST,)] = {"name": meta["name"], "since": ready.get("lastTransitionTime") or "",
                             "message": (ready.get("message") or "")[:256],
                             "fenced": any(t.get("key") in FENCING_TAINTS and t.get("effect") == "NoSchedule"
                                           for t in (body.get("spec") or {}).get("taints") or [])}
    return out


@kopf.index("v1", "resourcequotas")
async def quotas(body, namespace, **_):
    return {namespace: slim_obj(body, spec=dict(body.get("spec") or {}),
                            status=dict(body.get("status") or {}))}


# ---- DataStages and their children ------------------------------------------------------------

@kopf.index(GROUP, VERSION, "datastages")
async def stage_bodies(body, name, namespace, **_):
    return {(namespace, name): slim_owner(body)}


# One index for a DataStage's children (why: dtj_children)
@kopf.index("v1", "services", labels=_HAS_STAGE)
@kopf.index("apps", "v1", "statefulsets", labels=_HAS_STAGE)
@kopf.index("batch", "v1", "jobs", labels=_HAS_STAGE)
async def stage_children(body, namespace, **_):
    kind = body.get("kind")
    if kind == "Service":
        slim = slim_obj(body, spec={"clusterIP": (body.get("spec") or {}).get("clusterIP")})
    else:
        slim = slim_obj(body, status=dict(body.get("status") or {}))
    return {(namespace, body["metadata"]["labels"][LABEL_STAGE], kind): slim}


# (one index for both, and one for the cluster-scoped kinds below: why at dtj_children)
@kopf.index("v1", "serviceaccounts")
@kopf.index("v1", "persistentvolumeclaims")
async def references(body, name, namespace, **_):
    return {(body.get("kind"), namespace, name): name}


# ---- priority classes and flavors (cluster-scoped; only admins create them) -------------------

@kopf.index("scheduling.k8s.io", "v1", "priorityclasses")
@kopf.index(KUEUE_GROUP, KUEUE_VERSION, "workloadpriorityclasses")
@kopf.index(KUEUE_GROUP, KUEUE_VERSION, "resourceflavors")
async def scheduling(body, name, **_):
    kind = body.get("kind")
    if kind == "ResourceFlavor":
        spec = body.get("spec") or {}
        return {(kind, name): {"metadata": {"name": name}, "spec": {
            "nodeLabels": dict(spec.get("nodeLabels") or {}),
            "tolerations": [dict(t) for t in spec.get("tolerations") or []]}}}
    return {(kind, name): {"metadata": {"name": name}, "value": body.get("value"),
                           "globalDefault": body.get("globalDefault")}}


INDEXES = ("dtj_bodies", "dtj_admission", "nodes", "quotas", "stage_bodies", "stage_children",
           "references", "scheduling")


# ---- routing: a change wakes the reconcile of whoever owns or reads it -----------------------

@kopf.on.event(GROUP, VERSION, "distributedtrainingjobs")
async def route_job(type, name, namespace, body, memo: kopf.Memo, **_) -> None:  # noqa: A002
    # the Prometheus gauges follow what the API server holds, also for objects no reconcile
    # reached yet (here, not in a watcher of its own: one kopf handler fewer per event)
    metrics.observe(metrics.JOB_KIND, body, deleted=type == "DELETED")
    ctl = memo.controller
    if type == "DELETED":
        ctl.job_gone(namespace, name, body["metadata"].get("uid"))
    else:
        ctl.enqueue_job(namespace, name)
    spec = body.get("spec") or {}
    if type == "DELETED" or phases.finished(body) or (spec.get("runPolicy") or {}).get("suspend"):
        ctl.wake_gate(namespace)  # its quota is free for the queue


@kopf.on.event(KUEUE_GROUP, KUEUE_VERSION, "workloads", labels=_HAS_JOB)
@kopf.on.event(*PLUGINS_API, "podgroups", labels=_HAS_JOB)
@kopf.on.event(*VOLCANO_API, "podgroups", labels=_HAS_JOB)
async def route_job_child(body, namespace, memo: kopf.Memo, **_) -> None:
    memo.controller.enqueue_job(*_job_key(body, namespace))


# ---- children applied but not read: watched so that one deleted or edited comes back ----------

RBAC = "rbac.authorization.k8s.io"


@kopf.on.event("v1", "serviceaccounts", labels=_HAS_JOB)
@kopf.on.event(RBAC, "v1", "roles", labels=_HAS_JOB)
@kopf.on.event(RBAC, "v1", "rolebindings", labels=_HAS_JOB)
async def route_job_applied(type, body, namespace, memo: kopf.Memo, **_) -> None:  # noqa: A002
    memo.controller.child_changed(JOB_KIND, *_job_key(body, namespace), dict(body),
                                  type == "DELETED")


@kopf.on.event("v1", "serviceaccounts", labels=_HAS_STAGE)
@kopf.on.event(RBAC, "v1", "roles", labels=_HAS_STAGE)
@kopf.on.event(RBAC, "v1", "rolebindings", labels=_HAS_STAGE)
@kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=_HAS_STAGE)
@kopf.on.event("v1", "persistentvolumeclaims", labels=_HAS_STAGE)
async def route_stage_applied(type, body, namespace, memo: kopf.Memo, **_) -> None:  # noqa: A002
    memo.controller.child_changed(STAGE_KIND, namespace, body["metadata"]["labels"][LABEL_STAGE],
                                  dict(body), type == "DELETED")


@kopf.on.event("v1", "resourcequotas")
async def route_quota(namespace, memo: kopf.Memo, **_) -> None:
    memo.controller.wake_gate(namespace)


@kopf.on.event("scheduling.k8s.io", "v1", "priorityclasses")
@kopf.on.event(KUEUE_GROUP, KUEUE_VERSION, "workloadpriorityclasses")
async def route_priority_class(type, memo: kopf.Memo, **_) -> None:  # noqa: A002
    if type in ("ADDED", "MODIFIED", "DELETED"):  # a value or the default changed: the order
        memo.controller.wake_all_gates()


@kopf.on.event(KUEUE_GROUP, KUEUE_VERSION, "resourceflavors")
async def route_resource_flavor(type, name, memo: kopf.Memo, **_) -> None:  # noqa: A002
    if type in ("ADDED", "MODIFIED"):  # a job admitted on it may wait for the cache to have it
        memo.controller.wake_waiting_for_flavor(name)


@kopf.on.event("v1", "nodes")
async def route_node(type, body, memo: kopf.Memo, **_) -> None:  # noqa: A002
    memo.controller.node_changed()
    if type in ("ADDED", "DELETED"):  # not heartbeats; label edits wait for the resync
        memo.controller.wake_waiting_for_nodes()
    if type == "DELETED":  # its pods are lost now, not after PodGC's quarantine
        memo.controller.node_deleted(body["metadata"]["name"])
    elif type == "ADDED":
        memo.controller.node_added(body["metadata"]["name"])
    if type == "MODIFIED" and node_lost(body):  # the gangs with a pod there restart now
        memo.controller.wake_jobs_on_node(body["metadata"]["name"])
        memo.controller.wake_starting()  # (a gang waits for the lost node's taint: gang.py)
    elif type == "MODIFIED":  # a lost node back: room for a shrunk elastic gang
        memo.controller.node_back(body["metadata"]["name"])


@kopf.on.event(GROUP, VERSION, "datastages")
async def route_stage(type, name, namespace, body, memo: kopf.Memo, **_) -> None:  # noqa: A002
    metrics.observe(metrics.STAGE_KIND, body, deleted=type == "DELETED")  # (see route_job)
    ctl = memo.controller
    if type == "DELETED":
        ctl.stage_gone(namespace, name)
    else:
        ctl.enqueue_stage(namespace, name)
    ctl.wake_jobs_of_stage(namespace, name)


@kopf.on.event("v1", "services", labels=_HAS_STAGE)
@kopf.on.event("apps", "v1", "statefulsets", labels=_HAS_STAGE)
@kopf.on.event("batch", "v1", "jobs", labels=_HAS_STAGE)
async def route_stage_child(body, namespace, memo: kopf.Memo, **_) -> None:
    memo.controller.enqueue_stage(namespace, body["metadata"]["labels"][LABEL_STAGE])


@kopf.on.event("v1", "serviceaccounts")
@kopf.on.event("v1", "persistentvolumeclaims")
async def route_reference(type, name, namespace, memo: kopf.Memo, **_) -> None:  # noqa: A002
    if type in ("ADDED", "MODIFIED", "DELETED"):  # (the initial listing wakes nobody)
        memo.controller.wake_stages_referencing(namespace, name)
