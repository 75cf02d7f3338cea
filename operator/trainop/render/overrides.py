"""spec.podTemplate merged into a rendered pod: the last step of render_worker/render_launcher.
Pure: the rendered pod and the override in, the pod changed in place; SpecError naming the
override's field for anything that contradicts what the operator rendered.

    overrides.apply(pod, job.pod_template.get("worker"), "spec.podTemplate.worker")

The operator's fields win, and a contradiction is refused, never dropped (docs/pod-template.md):
- metadata.labels/annotations: added; a key the pod has with another value, or any trainop.io/
  key, is refused.
- spec.nodeSelector: keys added; a key the pool sets to another value is refused.
- spec.tolerations, spec.imagePullSecrets: appended (an identical entry once).
- spec.affinity: nodeAffinity, podAffinity, podAntiAffinity each added when the operator set
  none, else refused.
- spec.hostNetwork/hostPID/hostIPC: copied (spec.py already judged them against the config).
- spec.volumes: appended; a name the pod has is refused.
- spec.initContainers: appended after the operator's (its native sidecar starts first).
- spec.containers: the entry named like the training container (containers[0]) adds env (a
  name the operator sets, or a launcher/rank variable, is refused), envFrom (the operator's env
  entries win over it, as Kubernetes orders them), volumeMounts (a mountPath the container
  has, or one inside it, is refused) and securityContext (a key the operator set to another value is refused;
  added capabilities join its own); any other name is a sidecar appended after the operator's
  containers, with restricted's securityContext under the user's.
- spec.priorityClassName: not merged here; spec.py makes it the job's priority class, which
  priority.py judges and the renderer puts on every pod.
A container's volumeMounts must name a volume of the merged pod, and never one of the
operator's that holds a credential (the shipper's API token, the SSH Secret): job code gets
only what the operator mounts for it. `check_reserved` refuses a container or volume name the
operator uses in any pod of the role (dtj.check_overrides collects them from every variant).
"""

from __future__ import annotations

import copy
import re

from trainop import GROUP
from trainop.render import common
from trainop.spec import SpecError

OPERATOR_PREFIX = f"{GROUP}/"
# What joins a pod to its PodGroup (render/podgroup.py): set only by the operator.
GANG_KEYS = ("scheduling.x-k8s.io/pod-group", "scheduling.k8s.io/group-name")
TRAINING_FIELDS = ("name", "env", "envFrom", "volumeMounts", "securityContext")
TRAINING_NAMES = ("worker", "launcher")  # the training container of each role (render/dtj.py)
# Variables mpirun, PMIx and torchrun give each rank: a value from the pod would mislead it.
RESERVED_ENV = re.compile(r"^(OMPI_|PMIX_|PMI_|HYDRA_|I_MPI_|TORCHELASTIC_|TRAINOP_)|"
                          r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|"
                          r"ROLE_RANK|ROLE_WORLD_SIZE|MASTER_ADDR|MASTER_PORT)$")
AFFINITY_PARTS = ("nodeAffinity", "podAffinity", "podAntiAffinity")


def apply(pod: dict, override: dict | None, where: str) -> None:
    """Merge `override` ({metadata, spec}) into `pod` ({metadata, spec}) in place."""
    if not override:
        return
    override = copy.deepcopy(override)
    meta = override.get("metadata") or {}
    for kind in ("labels", "annotations"):
        _add_keys(pod["metadata"], kind, meta.get(kind) or {}, f"{where}.metadata.{kind}",
                  reserved=OPERATOR_PREFIX)
    spec, ps = override.get("spec") or {}, pod["spec"]
    _add_keys(ps, "nodeSelector", spec.get("nodeSelector") or {}, f"{where}.spec.nodeSelector")
    for key, same in (("tolerations", lambda a, b: a == b),
                      ("imagePullSecrets", lambda a, b: a.get("name") == b.get("name"))):
        for entry in spec.get(key) or []:
            if not any(same(entry, have) for have in ps.get(key) or []):
                ps.setdefault(key, []).append(entry)
    for part, value in (spec.get("affinity") or {}).items():
        if part in (ps.get("affinity") or {}):
            raise SpecError(f"{where}.spec.affinity.{part}", f"the operator sets the pod's {part} "
                            f"itself: express the placement with nodeSelector or tolerations")
        ps.setdefault("affinity", {})[part] = value
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if key in spec:
            ps[key] = spec[key]
    have = {v["name"] for v in ps.get("volumes") or []}
    secret = {v["name"] for v in ps.get("volumes") or [] if holds_credential(v)}
    for i, volume in enumerate(spec.get("volumes") or []):
        if volume["name"] in have:
            raise SpecError(f"{where}.spec.volumes[{i}].name", f"{volume['name']!r} is a volume "
                            f"the operator mounts in this pod: choose another name")
        have.add(volume["name"])
        ps.setdefault("volumes", []).append(volume)
    names = {c["name"] for c in ps["containers"] + ps.get("initContainers", [])}
    training = ps["containers"][0]
    for key in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(key) or []):
            here = f"{where}.spec.{key}[{i}]"
            if key == "containers" and c["name"] == training["name"]:
                _merge_training(training, c, here, have - secret, secret)
                continue
            if c["name"] in names:
                raise SpecError(f"{here}.name", f"{c['name']!r} is a container the operator runs "
                                f"in this pod: choose another name")
            names.add(c["name"])
            _check_mounts(c.get("volumeMounts") or [], here, have - secret, secret)
            sc = common.container_security_context()
            _merge_security(sc, c.get("securityContext") or {}, here, strict=False)
            c["securityContext"] = sc
            ps.setdefault(key, []).append(c)


def _add_keys(parent: dict, key: str, extra: dict, where: str, reserved: str | None = None) -> None:
    if not extra:
        return
    have = parent.setdefault(key, {})
    for k, v in extra.items():
        if reserved and (k.startswith(reserved) or k in GANG_KEYS):
            raise SpecError(f"{where}[{k}]", f"keys under {reserved} are the operator's: choose "
                                            f"another key")
        if k in have and have[k] != v:
            raise SpecError(f"{where}[{k}]", f"the operator sets {k}={have[k]!r} here: remove it "
                                            f"or set the same value")
        have[k] = v


def holds_credential(volume: dict) -> bool:
    """A Secret volume, or a projected one with a Secret or a ServiceAccount token in it."""
    sources = (volume.get("projected") or {}).get("sources") or []
    return "secret" in volume or any("secret" in s or "serviceAccountToken" in s for s in sources)


def check_reserved(override: dict, where: str, containers: set[str], volumes: set[str]) -> None:
    """SpecError for a container or volume of `override` named like one the operator renders
    in some pod of the role (`containers`, `volumes`): a name this pod lacks would still
    collide in another (worker 0's shipper, a later attempt's fetch-checkpoint)."""
    spec = override.get("spec") or {}
    for i, volume in enumerate(spec.get("volumes") or []):
        if volume["name"] in volumes:
            raise SpecError(f"{where}.spec.volumes[{i}].name", f"{volume['name']!r} is a volume "
                            f"the operator mounts in this role's pods: choose another name")
    for key in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(key) or []):
            if c["name"] in containers and not (key == "containers" and c["name"] in TRAINING_NAMES):
                raise SpecError(f"{where}.spec.{key}[{i}].name", f"{c['name']!r} is a container "
                                f"the operator runs in this role's pods: choose another name")


def _check_mounts(mounts: list[dict], where: str, volumes: set[str],
                  secret: set[str] = frozenset()) -> None:
    for j, mount in enumerate(mounts):
        if mount["name"] in secret:
            raise SpecError(f"{where}.volumeMounts[{j}].name", f"{mount['name']!r} holds a "
                            f"credential of the operator (an API token, the SSH key): only the "
                            f"operator's own containers mount it")
        if mount["name"] not in volumes:
            raise SpecError(f"{where}.volumeMounts[{j}].name", f"no volume {mount['name']!r} in "
                            f"this pod: add it to spec.volumes of the same podTemplate role")


def _merge_training(container: dict, extra: dict, where: str, volumes: set[str],
                    secret: set[str]) -> None:
    for key in extra:
        if key not in TRAINING_FIELDS:
            raise SpecError(f"{where}.{key}", f"the training container takes only "
                            f"{', '.join(TRAINING_FIELDS[1:])} from a pod template: its image, "
                            f"command and resources come from spec.image, spec.command and "
                            f"spec.resources")
    env_names = {e["name"] for e in container.get("env") or []}
    for j, env in enumerate(extra.get("env") or []):
        name = env["name"]
        if name in env_names:
            raise SpecError(f"{where}.env[{j}].name", f"{name} is set by the operator (or by "
                            f"spec.env): set it in one place, spec.env")
        if RESERVED_ENV.match(name):
            raise SpecError(f"{where}.env[{j}].name", f"{name} is set by the launcher (mpirun or "
                            f"torchrun) or the operator for every rank: choose another name")
        env_names.add(name)
        container.setdefault("env", []).append(env)
    container.setdefault("envFrom", []).extend(extra.get("envFrom") or [])
    if not container["envFrom"]:
        del container["envFrom"]
    _check_mounts(extra.get("volumeMounts") or [], where, volumes, secret)
    own = [m["mountPath"].rstrip("/") for m in container.get("volumeMounts") or []]
    for j, mount in enumerate(extra.get("volumeMounts") or []):
        path = mount["mountPath"].rstrip("/")
        inside = next((p for p in own if path == p or path.startswith(p + "/")), None)
        if inside:
            raise SpecError(f"{where}.volumeMounts[{j}].mountPath", f"the operator mounts "
                            f"{inside} itself (the same path or one inside it): choose another path")
        own.append(path)
        container.setdefault("volumeMounts", []).append(mount)
    _merge_security(container.setdefault("securityContext", {}), extra.get("securityContext") or {},
                    where, strict=True)


def _merge_security(sc: dict, extra: dict, where: str, strict: bool) -> None:
    """`extra` (a user's container securityContext, already judged by spec.py against the
    admin's podTemplate.allow) into the operator's `sc`: added and dropped capabilities join
    its own (drop ALL stays). `strict` (the training container): a key the operator set to
    another value, or another user, is refused; otherwise (a sidecar) the user's value wins."""
    for key, value in extra.items():
        if key == "capabilities":
            caps = sc.setdefault("capabilities", {})
            for which in ("drop", "add"):
                for cap in value.get(which) or []:
                    if cap not in caps.setdefault(which, []):
                        caps[which].append(cap)
            continue
        if strict and key in sc and sc[key] != value:
            raise SpecError(f"{where}.securityContext.{key}", f"the operator sets {key}="
                            f"{sc[key]!r} on the training container: remove it")
        if strict and key in ("runAsUser", "runAsGroup") and value is not None:
            raise SpecError(f"{where}.securityContext.{key}", "the training container runs as "
                            "spec.securityContext's user (ssh and the shared files rely on it): "
                            "set spec.securityContext instead")
        sc[key] = value
