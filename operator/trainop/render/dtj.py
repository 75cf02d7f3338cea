"""DistributedTrainingJob -> child manifests. Pure: a parsed spec.Job in, dicts out.

Children (names are deterministic so a restarted operator finds what it made):
  Service     <job>                 headless; gives worker i the DNS name host(job, i)
  Secret      <job>-ssh             SSH key pair (also the sshd host key), authorized_keys, known_hosts
  ConfigMap   <job>-mpi             hostfile, hosts, sshd_config, ssh_config, ssh wrapper, ssh-session
  Pod         <job>-worker-<i>      sshd (mpi) or torchrun (torchrun)
  Job         <job>-launcher        mpirun over ssh (mpi only)
"""

from __future__ import annotations

import base64
import dataclasses
import math
import re
import shlex

from trainop import blob
from trainop.render import common, fabric, logship, overrides, podgroup
from trainop.resume import Resume
from trainop.spec import CHECKPOINT_VOLUME_MOUNT, Job

SSH_PORT = 2222  # unprivileged, so the same config works for non-root images
SSHD_CAPABILITY = "NET_BIND_SERVICE"  # in the MPI workers' bounding set (render_worker)
RDZV_PORT = 29400
DNS_WAIT_SECONDS = 300
SSH_DIR = f"{common.MOUNT_ROOT}/ssh"
CONF_DIR = f"{common.MOUNT_ROOT}/mpi"
OUTPUT_DIR = "/output"
SSH_KEY = "id_ed25519"
WORKER, LAUNCHER = "worker", "launcher"
# The Kueue Workload's pod sets (kueue.render_workload), whose admitted flavors place the pods.
WORKER_POD_SET, LAUNCHER_POD_SET = "workers", "launcher"


# ---- names ------------------------------------------------------------------------------------
def service_name(job: Job) -> str:
    return job.name


def secret_name(job: Job) -> str:
    return f"{job.name}-ssh"


def config_map_name(job: Job) -> str:
    return f"{job.name}-mpi"


def worker_name(job: Job, index: int) -> str:
    return f"{job.name}-worker-{index}"


def network_policy_name(job: Job) -> str:
    return job.name


def launcher_name(job: Job) -> str:
    return f"{job.name}-launcher"


def host(job: Job, index: int) -> str:
    """Worker i's DNS name through the headless Service (cluster-domain independent)."""
    return f"{worker_name(job, index)}.{service_name(job)}.{job.namespace}.svc"


def launcher_service_name(job: Job) -> str:
    """The headless Service that names a launcher running ranks (runLauncherAsWorker)."""
    return launcher_name(job)


def rank_hosts(job: Job) -> list[str]:
    """Every pod that runs ranks, in hostfile order: a launcher that runs ranks first (Open MPI
    maps its first ranks, rank 0 included, to mpirun's own node wherever the hostfile lists it,
    so every MPI gets the MPI Operator's order), then the workers."""
    hosts = [host(job, i) for i in range(job.workers)]
    if job.launcher_as_worker:
        hosts.insert(0, f"{launcher_name(job)}.{launcher_service_name(job)}.{job.namespace}.svc")
    return hosts


def _labels(job: Job, role: str | None = None, index: int | None = None,
            attempt: int | None = None) -> dict[str, str]:
    out = common.labels(job.name, role, index)
    if attempt is not None:
        out[common.LABEL_ATTEMPT] = str(attempt)
    return out


# ---- commands and environment -----------------------------------------------------------------
def trainer_args(job: Job) -> list[str]:
    """The trainer contract of docs/DEVELOPING.md."""
    t = job.training
    args = ["--framework", job.framework,
            "--backend", "horovod" if job.launcher == "mpi" else "native"]
    args += ["--synthetic"] if job.synthetic else ["--data-dir", job.data_mount_path]
    args += ["--batch-size", str(t.batch_size), "--epochs", str(t.epochs)]
    if t.steps_per_epoch:
        args += ["--steps-per-epoch", str(t.steps_per_epoch)]
    if t.image_size:
        args += ["--image-size", str(t.image_size)]
    args += ["--precision", t.precision]
    if t.channels_last:
        args.append("--channels-last")
    if t.compile:
        args.append("--compile")
    return args + ["--output-dir", OUTPUT_DIR, "--metrics-file", f"{OUTPUT_DIR}/metrics.jsonl"]


def rank_command(job: Job) -> list[str]:
    """What every rank runs. Like a container's command/args: command alone runs without the
    trainer's arguments; args alone replace the trainer's arguments."""
    if job.command:
        return [*job.command, *(job.args or ())]
    return ["python", "-m", "trainop_trainer",
            *(job.args if job.args is not None else trainer_args(job))]


def network_env(job: Job) -> dict[str, str]:
    """Transport settings: InfiniBand through the RDMA device, or TCP forced everywhere (so a
    job on an IB-less pool never waits on a missing HCA)."""
    if job.infiniband:
        env = {"NCCL_IB_DISABLE": "0", "NCCL_IB_PCI_RELAXED_ORDERING": "1",
               "UCX_TLS": "rc,sm,self", "UCX_IB_PCI_RELAXED_ORDERING": "on"}
        env |= {"OpenMPI": {"OMPI_MCA_pml": "ucx", "OMPI_MCA_btl": "^openib"},
                "Intel": {"I_MPI_FABRICS": "shm:ofi", "FI_PROVIDER": "mlx"},
                "MPICH": {}}[job.mpi_implementation]
    else:
        env = {"NCCL_IB_DISABLE": "1"}
        env |= {"OpenMPI": {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,vader,tcp"},
                "Intel": {"I_MPI_FABRICS": "shm:ofi", "FI_PROVIDER": "tcp"},
                "MPICH": {}}[job.mpi_implementation]
    return env


def checkpoint_env(job: Job, attempt: int, resume: Resume | None) -> dict[str, str]:
    """Where the trainer (or any training code) saves and what it resumes from (resume.py).
    Always all three names, so mpirun's `-x` list is the same for every attempt."""
    if job.checkpoint is None:
        return {}
    return {"TRAINOP_CHECKPOINT_DIR": job.checkpoint.attempt_dir(attempt),
            "TRAINOP_CHECKPOINT_EVERY": str(job.checkpoint.every_steps),
            "TRAINOP_RESUME_FROM": resume.resume_from if resume else ""}


def container_env(job: Job, attempt: int = 0, resume: Resume | None = None) -> list[dict]:
    base = {"PYTHONUNBUFFERED": "1", "TRAINOP_JOB_NAME": job.name} | network_env(job) | \
        checkpoint_env(job, attempt, resume)
    if job.elastic is not None:
        # The trainer keeps the global batch at this world's at every size (gradient
        # accumulation), so a resized gang trains the same run (docs/elastic.md).
        base["TRAINOP_ELASTIC_MAX_WORLD"] = str(elastic_max_world(job))
    if job.run_policy.stall_timeout_seconds:  # each rank's watchdog (trainop_trainer/stall.py)
        base["TRAINOP_STALL_SECONDS"] = str(job.run_policy.stall_timeout_seconds)
    if job.launcher == "mpi" and job.mpi_implementation == "OpenMPI":
        # Ranks learn where every other rank runs (for a native backend's rendezvous and local
        # ranks) from the hostfile, as under the MPI Operator; mpirun forwards this with -x.
        base["OMPI_MCA_orte_default_hostfile"] = f"{CONF_DIR}/hostfile"
        if job.security.root:  # (PRRTE's mpirun of Open MPI 5 honours them too, seen)
            base |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    user = {e["name"] for e in job.env}
    return common.env({k: v for k, v in base.items() if k not in user}) + [dict(e) for e in job.env]


def _gives(args: tuple[str, ...], flag: str) -> bool:
    """Does spec.mpirun.extraArgs set `flag` (-flag, --flag, --flag=value)?"""
    return any(a.startswith("-") and a.lstrip("-").split("=", 1)[0] == flag for a in args)


# The launcher pod's IP (downward API, MPICH jobs). Hydra's proxies on the workers call mpiexec
# back at the name it gives them, by default its hostname, which no other pod resolves (the
# launcher is a Job's pod, outside the job's Service); MPICH 4.2 on real pods:
# "unable to get host address for <launcher pod>". The launcher's shell expands HYDRA_LOCALHOST
# (to nothing where the variable is unset: `trainop run --local`).
POD_IP_ENV = "TRAINOP_POD_IP"
HYDRA_LOCALHOST = f"${{{POD_IP_ENV}:+-localhost ${POD_IP_ENV}}}"


def mpirun_command(job: Job) -> list[str]:
    hostfile = f"{CONF_DIR}/hostfile"
    user = job.mpirun_args
    if job.mpi_implementation == "OpenMPI":
        forwarded = ["PATH"] + [e["name"] for e in container_env(job)]
        return ["mpirun", "-np", str(job.total_slots), "--hostfile", hostfile,
                *([] if _gives(user, "map-by") else ["--map-by", "slot"]),
                # Open MPI's default core binding cost 20% of GPU throughput (TOOLCHAIN.md), and
                # container CPU quotas do not line up with cores anyway.
                *([] if _gives(user, "bind-to") else ["--bind-to", "none"]),
                "--mca", "orte_keep_fqdn_hostnames", "1",
                # Only the launcher sshes; workers never need to reach each other over ssh.
                "--mca", "plm_rsh_no_tree_spawn", "1",
                "--mca", "plm_rsh_agent", "ssh",
                "--mca", "plm_rsh_args", f"-F {CONF_DIR}/ssh_config",
                *[x for name in forwarded for x in ("-x", name)],
                *user, *rank_command(job)]
    # Hydra (Intel MPI, MPICH) forwards the whole environment by default.
    launcher = ["-bootstrap", "ssh", "-bootstrap-exec"] if job.mpi_implementation == "Intel" \
        else ["-launcher", "ssh", "-launcher-exec"]
    localhost = [HYDRA_LOCALHOST] if job.mpi_implementation == "MPICH" else []
    return ["mpirun", "-f", hostfile, "-n", str(job.total_slots), "-ppn",
            str(job.slots_per_worker), *launcher, f"{CONF_DIR}/ssh", *localhost, *user,
            *rank_command(job)]


def launcher_env(job: Job) -> dict[str, str]:
    """What spec.mpirun.command may name as $(NAME), and finds in its environment."""
    return {"TRAINOP_HOSTFILE": f"{CONF_DIR}/hostfile", "TRAINOP_NUM_RANKS": str(job.total_slots),
            "TRAINOP_SLOTS_PER_WORKER": str(job.slots_per_worker),
            "TRAINOP_SSH": f"{CONF_DIR}/ssh", "TRAINOP_SSH_PORT": str(SSH_PORT)}


_VAR = re.compile(r"\$(\$|\(([A-Za-z_][A-Za-z0-9_]*)\))")


def launcher_command(job: Job) -> list[str]:
    """spec.mpirun.command with $(NAME) replaced as Kubernetes replaces it in a container's
    command ($$ is a literal $; an unknown name stays as written), else the rendered mpirun."""
    if not job.launcher_command:
        return mpirun_command(job)
    values = launcher_env(job)

    def one(match: re.Match) -> str:
        if match.group(1) == "$":
            return "$"
        return values.get(match.group(2), match.group(0))
    return [_VAR.sub(one, arg) for arg in job.launcher_command]


def _shell_join(cmd: list[str]) -> str:
    """shlex.join, but HYDRA_LOCALHOST left for the shell to expand."""
    return " ".join(arg if arg == HYDRA_LOCALHOST else shlex.quote(arg) for arg in cmd)


def _wait_for_dns(hosts_expr: str) -> list[str]:
    """Shell lines that wait, bounded, until every host resolves: the workers from the launcher's
    hostAliases at once; the launcher's own name (runLauncherAsWorker) and any host a pod
    template's command adds through cluster DNS, which can lag: never let that crash the gang."""
    return [
        f"deadline=$(($(date +%s) + {DNS_WAIT_SECONDS}))",
        f"for host in {hosts_expr}; do",
        '  until getent hosts "$host" >/dev/null; do',
        '    if [ "$(date +%s)" -ge "$deadline" ]; then',
        f'      echo "trainop: $host does not resolve after {DNS_WAIT_SECONDS}s" >&2; exit 1',
        "    fi",
        "    sleep 1",
        "  done",
        "done",
    ]


def launcher_script(job: Job) -> str:
    # mpirun is not exec'd: the kubelet's SIGTERM (the gang stopping) goes to this shell, which
    # lets mpirun run on, since mpirun would kill the ranks within seconds; the workers' shells
    # hand the signal to the ranks instead, which save a checkpoint and end, and mpirun with them.
    return fabric.memlock_preamble(job) + "\n".join([
        "set -eu", *_wait_for_dns(f"$(cat {CONF_DIR}/hosts)"),
        _shell_join(launcher_command(job)) + " &",
        "mpirun=$!",
        "trap 'echo \"trainop: stopping: the ranks save and end, mpirun with them\" >&2' TERM",
        "set +e",
        'while :; do wait "$mpirun"; status=$?; kill -0 "$mpirun" 2>/dev/null || exit "$status"; done',
    ]) + "\n"


def torchrun_script(job: Job) -> str:
    rdzv = f"{host(job, 0)}:{RDZV_PORT}"
    program = rank_command(job)
    if program[:3] == ["python", "-m", "trainop_trainer"]:
        target = ["-m", "trainop_trainer", *program[3:]]
    else:
        target = ["--no-python", *program]
    cmd = ["torchrun", f"--nnodes={job.workers}", f"--nproc-per-node={job.slots_per_worker}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv}", f"--rdzv-id={job.name}",
           "--max-restarts=0", *target]
    # torchrun is not exec'd: given a SIGTERM, it passes it to its ranks and SIGKILLs them 30 s
    # later (torch.distributed.elastic's fixed timeout), which would cut a slower save short.
    # This shell hands the kubelet's SIGTERM to the ranks (torchrun's children) instead; they
    # save and end, torchrun with them, within the pod's grace period.
    return fabric.memlock_preamble(job) + _TORCHRUN_RANKS + stop_ranks(rank_deadline(job), ":") + \
        "\n".join([
        "set -eu", *_wait_for_dns(host(job, 0)),
        shlex.join(cmd) + " &",
        "torchrun=$!",
        "trap stop TERM",
        "set +e",
        'while :; do wait "$torchrun"; status=$?; kill -0 "$torchrun" 2>/dev/null || exit "$status"; done',
    ]) + "\n"


# The worker container's environment, as its shell exports it (`export -p`: quoted for that same
# shell to read back), for the ssh sessions mpirun starts the ranks in (ssh_session).
WORKER_ENV = "/dev/shm/trainop-worker-env"


# The ranks are the children of the MPI daemon that the launcher's mpirun starts on each worker
# (Open MPI's orted, or prted from Open MPI 5, Hydra's proxy); not their own children, such as
# data-loader workers, which a SIGTERM would kill under their rank. "pid (comm) state ppid ...".
_RANKS = """\
ranks() {
  for stat in /proc/[0-9]*/stat; do
    read -r pid rest 2>/dev/null < "$stat" || continue
    ppid=${rest##*) }; ppid=${ppid#* }; ppid=${ppid%% *}
    case "$(cat "/proc/$ppid/comm" 2>/dev/null)" in orted|prted|hydra_pmi_proxy) echo "$pid" ;; esac
  done
}
"""
# torchrun's ranks: its children ($torchrun, set once it started).
_TORCHRUN_RANKS = """\
ranks() {
  for stat in /proc/[0-9]*/stat; do
    read -r pid rest 2>/dev/null < "$stat" || continue
    ppid=${rest##*) }; ppid=${ppid#* }; ppid=${ppid%% *}
    if [ "$ppid" = "${torchrun:-}" ]; then echo "$pid"; fi
  done
}
"""


def elastic_max_world(job: Job) -> int:
    """Ranks of the elastic gang at its largest size: maxWorkers x ranks per worker."""
    return job.elastic.max_workers * job.slots_per_worker


def stop_ranks(deadline: int, then: str) -> str:
    """The shell's `stop` (its SIGTERM trap; `ranks` lists the ranks): SIGTERM to the ranks,
    which save a checkpoint and end; then `then`. A rank still there `deadline` seconds later is
    hung (a stalled gang: frozen, or waiting in a collective for one that is): it will never
    save, and waiting on would spend the rest of the pod's grace period, which is the log
    shipper's drain (grace_seconds), until the kubelet's SIGKILL ends the shipper too. So it is
    SIGKILLed then, and the shipper drains as after any other end."""
    return "\n".join([
        "stop() {",
        '  for rank in $(ranks); do kill -TERM "$rank" 2>/dev/null; done',
        "  waited=0",
        f'  while [ -n "$(ranks)" ] && [ "$waited" -lt {deadline} ]; do sleep 1; waited=$((waited + 1)); done',
        '  for rank in $(ranks); do kill -KILL "$rank" 2>/dev/null; done',
        f"  {then}",
        "}",
    ]) + "\n"


def sshd_script(job: Job | None = None) -> str:
    """The MPI worker's shell. sshd runs as the job's non-root user: it can only log that user
    in, and needs neither the privilege-separation folder (/run/sshd) nor a PID file. Ranks
    inherit its memlock.

    sshd starts every session with a fresh environment, so what the worker container was given
    (the image's ENV, spec.podTemplate's env and envFrom) is written down first for ssh_session
    to restore; only the job's user can read it (it may hold a Secret's value, as the
    container's own environment does).

    sshd is not exec'd: as the container's first process, its exit on the kubelet's SIGTERM
    would end every process of the pod at once. This shell hands the SIGTERM to the ranks
    instead (the trainer saves a checkpoint on it, docs/long-runs.md) and ends when they have,
    or when the hung ones among them were killed (stop_ranks)."""
    preamble = fabric.memlock_preamble(job) if job is not None else ""
    deadline = rank_deadline(job) if job is not None else GRACE_FLOOR_SECONDS
    return preamble + _RANKS + stop_ranks(deadline, 'kill "$sshd" 2>/dev/null; exit 143') + "\n".join([
        f"(umask 077 && export -p > {WORKER_ENV})",
        # root's sshd separates privileges into this empty folder, which not every image has
        *(["mkdir -p /run/sshd"] if job is not None and job.security.root else []),
        f"/usr/sbin/sshd -D -e -f {CONF_DIR}/sshd_config &",
        "sshd=$!",
        "trap stop TERM",
        'wait "$sshd"',
        "status=$?",
        *_sshd_exec_failure(),
        'exit "$status"',
    ]) + "\n"


# The start of the termination message a worker writes when its shell could not exec sshd
# (exit 126 or 127); jobsync/failures.py names the cause SshdNotExecutable from it.
SSHD_EXEC_FAILED = "trainop: the image's /usr/sbin/sshd could not be executed"


def _sshd_exec_failure() -> list[str]:
    """Shell lines: when sshd could not be exec'd, say why, in the log and as the container's
    termination message (which the pod's status carries to the operator)."""
    fix = ("a file capability beyond NET_BIND_SERVICE, the one the worker's bounding set holds "
           "(see getcap /usr/sbin/sshd): remove it in the image (setcap -r /usr/sbin/sshd), or add "
           "that capability through spec.podTemplate.worker where the admin's "
           "podTemplate.allow.capabilities lists it")
    return [
        'if [ "$status" = 126 ] || [ "$status" = 127 ]; then',
        '  if [ ! -e /usr/sbin/sshd ]; then why="the image has none: install openssh-server"',
        '  elif [ ! -x /usr/sbin/sshd ]; then why="it is not executable by uid $(id -u)"',
        f'  else why="the kernel refused it (exit $status), most likely {fix}"; fi',
        f'  echo "{SSHD_EXEC_FAILED}: $why" | tee /dev/termination-log >&2',
        "fi",
    ]


def ssh_session() -> str:
    """sshd's ForceCommand on the workers: the session (Open MPI's orted, Hydra's proxy) gets the
    worker container's environment back, then runs what the client asked for with the user's
    shell, as sshd would have. What mpirun forwards (-x: spec.env and the operator's variables)
    is set on the ranks after this, so it still wins."""
    return "\n".join([
        "#!/bin/sh",
        'shell=${SHELL:-/bin/sh}',
        f"if [ -r {WORKER_ENV} ]; then . {WORKER_ENV}; fi",
        'if [ -z "${SSH_ORIGINAL_COMMAND:-}" ]; then exec "$shell" -l; fi',
        'exec "$shell" -c "$SSH_ORIGINAL_COMMAND"',
    ]) + "\n"


# ---- configuration files ----------------------------------------------------------------------
def hostfile(job: Job) -> str:
    if job.mpi_implementation == "OpenMPI":
        line = "{host} slots={slots}\n"
    else:
        line = "{host}:{slots}\n"
    return "".join(line.format(host=h, slots=job.slots_per_worker) for h in rank_hosts(job))


def sshd_config(root: bool = False) -> str:
    return "\n".join([
        f"Port {SSH_PORT}",
        f"HostKey {SSH_DIR}/{SSH_KEY}",
        f"AuthorizedKeysFile {SSH_DIR}/authorized_keys",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        # sshd logs in only the user it runs as: root only in a root job, by key only
        f"PermitRootLogin {'prohibit-password' if root else 'no'}",
        # Secret volumes are symlinks into root-owned folders: StrictModes would refuse them.
        "StrictModes no",
        "UsePAM no",
        "PidFile none",
        "PrintMotd no",
        f"ForceCommand {CONF_DIR}/ssh-session",
    ]) + "\n"


def ssh_config() -> str:
    return "\n".join([
        "Host *",
        f"  Port {SSH_PORT}",
        f"  IdentityFile {SSH_DIR}/{SSH_KEY}",
        "  IdentitiesOnly yes",
        # Every worker's host key is the job's own key: pin it rather than disable checking.
        f"  UserKnownHostsFile {SSH_DIR}/known_hosts",
        "  GlobalKnownHostsFile /dev/null",
        "  StrictHostKeyChecking yes",
        "  BatchMode yes",
        "  ConnectTimeout 10",
        "  ConnectionAttempts 6",
        "  LogLevel ERROR",
    ]) + "\n"


# ---- manifests --------------------------------------------------------------------------------
def render_launcher_service(job: Job) -> dict:
    """runLauncherAsWorker: the launcher's DNS name (<job>-launcher.<job>-launcher.<ns>.svc), a
    headless Service of its own so that the workers' Service keeps its selector."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": common.metadata(launcher_service_name(job), job.namespace, _labels(job)),
        "spec": {"clusterIP": "None", "selector": _labels(job, LAUNCHER),
                 # what the hostfile needs from the first moment: the pod's name, before mpirun
                 "publishNotReadyAddresses": True},
    }


def render_service(job: Job) -> dict:
    port = {"name": "ssh", "port": SSH_PORT} if job.launcher == "mpi" \
        else {"name": "rendezvous", "port": RDZV_PORT}
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": common.metadata(service_name(job), job.namespace, _labels(job)),
        "spec": {"clusterIP": "None", "selector": _labels(job, WORKER),
                 "ports": [{**port, "protocol": "TCP", "targetPort": port["port"]}],
                 **fabric.service_fields(job)},
    }


def render_network_policy(job: Job) -> dict:
    """The job's pods accept connections from the job's own pods only: sshd (2222) and the
    torchrun rendezvous (29400) are then closed to every other pod of the cluster. All ports
    between the job's pods stay open, because the data plane needs them: Open MPI's daemons
    call back to mpirun on the launcher, and NCCL, Gloo and Horovod rings listen on ephemeral
    ports. Policies add up, so a user who wants more in (a TensorBoard) adds their own.

    Egress: everything but the admin's jobNetwork.deniedEgressCIDRs (by default link-local, so
    Azure IMDS and the node's managed identity, and WireServer); the job's own pods and DNS
    (port 53, also a node-local cache on a link-local address) stay reachable. Policies add up
    here too, but only the admin (through the operator's configuration) can re-open a denied
    range: a user's policy that allows more egress to the job's pods does re-open it, so the
    namespace's users must not be able to write NetworkPolicies (docs/security.md)."""
    own = {"matchLabels": _labels(job)}
    spec: dict = {"podSelector": own, "policyTypes": ["Ingress"],
                  "ingress": [{"from": [{"podSelector": own}]}]}
    if job.denied_egress:
        v4 = [c for c in job.denied_egress if ":" not in c]
        v6 = [c for c in job.denied_egress if ":" in c]
        spec["policyTypes"].append("Egress")
        spec["egress"] = [
            {"to": [{"podSelector": own}]},
            {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
            {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", **({"except": v4} if v4 else {})}},
                    {"ipBlock": {"cidr": "::/0", **({"except": v6} if v6 else {})}}]},
        ]
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": common.metadata(network_policy_name(job), job.namespace, _labels(job)),
        "spec": spec,
    }


def render_ssh_secret(job: Job, private_key: str, public_key: str) -> dict:
    """The key pair comes from sshkeys.generate(), called once per job by the handler."""
    files = {SSH_KEY: private_key, f"{SSH_KEY}.pub": public_key + "\n",
             "authorized_keys": public_key + "\n", "known_hosts": f"* {public_key}\n"}
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": common.metadata(secret_name(job), job.namespace, _labels(job)),
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in files.items()},
    }


def render_config_map(job: Job) -> dict:
    hosts = "".join(h + "\n" for h in rank_hosts(job))
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": common.metadata(config_map_name(job), job.namespace, _labels(job)),
        "data": {"hostfile": hostfile(job), "hosts": hosts, "sshd_config": sshd_config(job.security.root),
                 "ssh_config": ssh_config(), "ssh-session": ssh_session(),
                 "ssh": f'#!/bin/sh\nexec ssh -F {CONF_DIR}/ssh_config "$@"\n'},
    }


def _placement(job: Job, pod_set: str) -> dict:
    """Where and in which order the scheduler places the job's pods: the node pool, plus what
    the ResourceFlavor Kueue admitted `pod_set` ("workers" or "launcher") on adds (kueue.place
    checked that its labels agree with the pool's)."""
    out: dict = {"nodeSelector": dict(job.placement.node_selector)}
    tolerations = [dict(t) for t in job.placement.tolerations]
    flavor = job.flavor(pod_set)
    if flavor is not None:
        out["nodeSelector"].update(flavor.node_selector)
        tolerations += [dict(t) for t in flavor.tolerations if t not in tolerations]
    if tolerations:
        out["tolerations"] = tolerations
    if job.pod_priority_class:  # the class the queue ordered the job by (priority.py)
        out["priorityClassName"] = job.pod_priority_class
    return out


# The SSH Secret's files: readable by the job's user and by nobody else. The kubelet writes a
# Secret volume's files as root (owner uid 0) with defaultMode, then, because the pod has an
# fsGroup, gives every file that group and ORs in 0440 (read-only volumes). So 0440 yields
# r--r----- root:<fsGroup>, and fsGroup is in every container's supplementary groups: the user
# reads the key through the group bit; any other uid (without that group) cannot. ssh and sshd
# refuse a private key readable by group or others only when the key file is owned by the
# user running them (OpenSSH's sshkey_perm_ok), and this one is owned by root, so both accept
# it, the client as IdentityFile and sshd as HostKey. (0600 would leave the user no access
# without an fsGroup and add nothing with one.)
SSH_SECRET_MODE = 0o440
# As root, ssh and sshd own the key (root owns the Secret's files) and so refuse it unless no
# group or other can read it (seen with OpenSSH 10: "UNPROTECTED PRIVATE KEY FILE").
SSH_SECRET_MODE_ROOT = 0o400
SSH_AUTH_VOLUME = "ssh-auth"  # spec.ssh.mountPath's copy of the key


def _ssh_volumes(job: Job) -> tuple[list[dict], list[dict]]:
    """The SSH Secret and the MPI ConfigMap as volumes and mounts (launcher and workers)."""
    items = [{"key": k, "path": k} for k in ("hostfile", "hosts", "sshd_config", "ssh_config")]
    volumes = [
        {"name": "ssh", "secret": {"secretName": secret_name(job),
                                    "defaultMode": SSH_SECRET_MODE_ROOT if job.security.root else SSH_SECRET_MODE}},
        {"name": "mpi", "configMap": {"name": config_map_name(job), "defaultMode": 0o444,
                                      "items": items + [{"key": key, "path": key, "mode": 0o555}
                                                        for key in ("ssh", "ssh-session")]}},
    ]
    mounts = [{"name": "ssh", "mountPath": SSH_DIR, "readOnly": True},
              {"name": "mpi", "mountPath": CONF_DIR, "readOnly": True}]
    if job.ssh_mount_path:
        # The MPI Operator's sshAuthMountPath: the key where an image's own ssh or sshd looks
        # (its file names; the key is ed25519 whatever the name says), with the same modes as
        # the operator's own copy above.
        files = {SSH_KEY: "id_rsa", f"{SSH_KEY}.pub": "id_rsa.pub",
                 "authorized_keys": "authorized_keys", "known_hosts": "known_hosts"}
        mode = SSH_SECRET_MODE_ROOT if job.security.root else SSH_SECRET_MODE
        volumes.append({"name": SSH_AUTH_VOLUME, "secret": {
            "secretName": secret_name(job), "defaultMode": mode,
            "items": [{"key": k, "path": p} for k, p in files.items()]}})
        mounts.append({"name": SSH_AUTH_VOLUME, "mountPath": job.ssh_mount_path, "readOnly": True})
    return volumes, mounts


# No API token in any container of a job's pods: training code must not be able to call the API
# server as the pod's ServiceAccount (it could otherwise write what the operator trusts). The
# one container that needs the API, worker 0's log shipper, gets a token projected into it
# alone (render/logship.py).
NO_TOKEN = {"automountServiceAccountToken": False}


CHECKPOINT_VOLUME = "checkpoints"


def checkpoint_volume(job: Job) -> dict:
    return {"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": job.checkpoint.claim}}


def _output_volume(job: Job) -> dict:
    if job.output and job.output.claim:
        return {"name": "output", "persistentVolumeClaim": {"claimName": job.output.claim}}
    return common.scratch_volume("output", job.empty_dir_size_limit)


def pod_security_context(job: Job) -> dict:
    """Every pod of the job runs as spec.securityContext's user. InfiniBand's memlock and
    IPC_LOCK: render/fabric.py and docs/security.md."""
    user = job.security
    if user.root:  # (an fsGroup would make the kubelet OR 0440 into the SSH key's mode)
        return common.pod_security_context({"runAsNonRoot": False, "runAsUser": 0, "runAsGroup": user.run_as_group})
    return common.pod_security_context({
        "runAsUser": user.run_as_user, "runAsGroup": user.run_as_group,
        "fsGroup": user.fs_group,
        # an output claim full of checkpoints is not re-chowned file by file at every start
        "fsGroupChangePolicy": "OnRootMismatch"})


# The ranks' share of a pod's grace period, sized from the job's slowest checkpoint save
# (status.checkpoint.saveSeconds): ceil(save x GRACE_MARGIN + GRACE_SLACK_SECONDS), at least
# Kubernetes' default, at most the admin's limits.maxCheckpointGraceSeconds. The slack covers
# what comes before and after the save: up to the trainer's STOP_CHECK_STEPS steps to the step
# boundary where the ranks agree to stop, the barrier, the exit.
GRACE_FLOOR_SECONDS = 30
GRACE_MARGIN = 1.5
GRACE_SLACK_SECONDS = 15


def save_grace(job: Job) -> int:
    """The seconds the ranks get from SIGTERM to save and end."""
    if job.save_seconds is None:
        return GRACE_FLOOR_SECONDS
    wanted = math.ceil(job.save_seconds * GRACE_MARGIN + GRACE_SLACK_SECONDS)
    return min(max(wanted, GRACE_FLOOR_SECONDS), job.max_checkpoint_grace_seconds)


def rank_deadline(job: Job) -> int:
    """The seconds a worker's shell waits for its ranks to save and end after the SIGTERM
    (stop_ranks): spec.terminationGracePeriodSeconds when set, else save_grace."""
    user = job.termination_grace_period_seconds
    return user if user is not None else save_grace(job)


def grace_seconds(job: Job, drain: int | None = None) -> int | None:
    """A pod's terminationGracePeriodSeconds (None: Kubernetes' 30 s); `drain`: its log
    shipper's drainSeconds, which the kubelet's SIGTERM reaches only once the training container
    has ended. spec.terminationGracePeriodSeconds wins, the drain plus 30 s being the least;
    else the ranks' share (save_grace) plus the drain."""
    user = job.termination_grace_period_seconds
    if user is not None:
        return user if drain is None else max(user, drain + GRACE_FLOOR_SECONDS)
    if drain is None and job.save_seconds is None:
        return None
    return (drain or 0) + save_grace(job)


def delete_grace_seconds(job: Job) -> int | None:
    """The gracePeriodSeconds of the operator's own deletions of the job's pods (a gang
    restart, a stop, a suspend, a Kueue eviction): the longest grace one of its pods would get
    now, so that a measure taken after the running pods were made applies to them too (a
    pod's own terminationGracePeriodSeconds cannot change). None (each pod's own) unless the
    grace comes from a measured save."""
    if job.termination_grace_period_seconds is not None or job.save_seconds is None:
        return None
    drain = int({**logship.DEFAULTS, **job.logship}["drainSeconds"]) if job.output else None
    return grace_seconds(job, drain)


def _grace(job: Job) -> dict:
    """The pod's grace period without a log shipper (grace_seconds)."""
    seconds = grace_seconds(job)
    return {} if seconds is None else {"terminationGracePeriodSeconds": seconds}


def _training_security(job: Job) -> dict:
    """Restricted's, but for a root job (the admin allowed it): the runtime's default
    capabilities, which root's sshd (its privilege separation: chroot, setuid) and Open MPI 5's
    mpirun need (seen: with drop ALL, sshd fails chroot("/run/sshd") and mpirun crashes)."""
    return {"allowPrivilegeEscalation": False} if job.security.root else common.container_security_context()


def _container_base(job: Job, name: str, attempt: int, resume: Resume | None) -> dict:
    out = {"name": name, "image": job.image, "env": container_env(job, attempt, resume),
           "securityContext": _training_security(job)}
    if job.image_pull_policy:
        out["imagePullPolicy"] = job.image_pull_policy
    return out


def worker_resources(job: Job) -> dict:
    requests = dict((job.resources or {}).get("requests") or {})
    limits = dict((job.resources or {}).get("limits") or {})
    if job.gpus_per_worker:
        limits[job.placement.gpu_resource] = job.gpus_per_worker
    if job.infiniband:
        limits[job.placement.rdma_resource] = 1
    out = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _ship_logs(job: Job, role: str, index: int | None, attempt: int, pod_spec: dict,
               labels: dict, annotations: dict, resume: Resume | None = None) -> None:
    """Merge the log shipper's parts (render/logship.py) into a pod being rendered."""
    mount = {"name": "output", "mountPath": OUTPUT_DIR} if role == WORKER else None
    container = pod_spec["containers"][0]
    parts = logship.pod_parts(job, role, index, attempt, container["command"], job.logship,
                              output_mount=mount, resume=resume)
    if parts is None:
        return
    container["command"] = parts.command
    container["volumeMounts"] = container.get("volumeMounts", []) + parts.mounts
    container["env"] = container["env"] + parts.env
    pod_spec["volumes"] = pod_spec["volumes"] + parts.volumes
    if parts.init_containers:
        pod_spec["initContainers"] = parts.init_containers
    labels.update(parts.labels)
    annotations.update(parts.annotations)
    if parts.service_account_name:
        pod_spec["serviceAccountName"] = parts.service_account_name
    if parts.drain_seconds is not None:
        pod_spec["terminationGracePeriodSeconds"] = grace_seconds(job, parts.drain_seconds)


def _rank_volumes(job: Job, claim_name: str | None, labels: dict) -> tuple[list[dict], list[dict]]:
    """What a pod that runs ranks mounts: /dev/shm, the output folder, the DataStage's claim
    (`claim_name`; its label goes on the pod), the checkpoint claim."""
    volumes = [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": job.shm_size}},
               _output_volume(job)]
    mounts = [{"name": "shm", "mountPath": "/dev/shm"},
              {"name": "output", "mountPath": OUTPUT_DIR}]
    if claim_name:
        labels[common.LABEL_READS_STAGE] = job.data_stage
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": claim_name,
                                                                  "readOnly": True}})
        mounts.append({"name": "data", "mountPath": job.data_mount_path, "readOnly": True})
    if job.checkpoint and job.checkpoint.claim:
        volumes.append(checkpoint_volume(job))
        mounts.append({"name": CHECKPOINT_VOLUME, "mountPath": CHECKPOINT_VOLUME_MOUNT})
    return volumes, mounts


def render_worker(job: Job, index: int, attempt: int, claim_name: str | None = None,
                  resume: Resume | None = None) -> dict:
    """Worker pod `index` of gang attempt `attempt`; `claim_name` is the DataStage's claim;
    `resume` what the attempt resumes from (resume.plan)."""
    labels = _labels(job, WORKER, index, attempt)
    container = _container_base(job, WORKER, attempt, resume)
    volumes, mounts = _rank_volumes(job, claim_name, labels)
    if job.launcher == "mpi":
        ssh_volumes, ssh_mounts = _ssh_volumes(job)
        volumes += ssh_volumes
        mounts += ssh_mounts
        # Stock MPI images (the MPI Operator's base since v0.4.0) give sshd the file capability
        # cap_net_bind_service=+eip; the kernel refuses to exec such a binary (EPERM, exit 126)
        # unless the capability is in the bounding set. Restricted Pod Security allows this one.
        if "capabilities" in container["securityContext"]:  # (root's defaults hold it already)
            container["securityContext"]["capabilities"]["add"] = [SSHD_CAPABILITY]
        container |= {"command": ["sh", "-c", sshd_script(job)],
                      "ports": [{"name": "ssh", "containerPort": SSH_PORT}],
                      "readinessProbe": {"tcpSocket": {"port": SSH_PORT},
                                         "periodSeconds": 2, "failureThreshold": 3}}
    else:
        container |= {"command": ["sh", "-c", torchrun_script(job)],
                      "ports": [{"name": "rendezvous", "containerPort": RDZV_PORT}]}
    resources = worker_resources(job)
    if resources:
        container["resources"] = resources
    container["volumeMounts"] = mounts
    pod_spec = {"hostname": worker_name(job, index), "subdomain": service_name(job),
                "restartPolicy": "Never", **_placement(job, WORKER_POD_SET), **NO_TOKEN,
                "securityContext": pod_security_context(job),
                "containers": [container], "volumes": volumes, **_grace(job)}
    annotations: dict[str, str] = {}
    _ship_logs(job, WORKER, index, attempt, pod_spec, labels, annotations, resume)
    fabric.shape_pod(job, pod_spec, WORKER, index, master=host(job, 0))
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": common.metadata(worker_name(job, index), job.namespace, labels, annotations),
        "spec": pod_spec,
    }
    podgroup.decorate(job, pod["metadata"], pod_spec)
    overrides.apply(pod, job.pod_template.get(WORKER), f"spec.podTemplate.{WORKER}")
    _confine(job, pod["metadata"], pod_spec)  # last: it covers what the template added
    return pod


def render_launcher(job: Job, attempt: int, resume: Resume | None = None,
                    claim_name: str | None = None, addresses: dict[str, str] | None = None) -> dict:
    """The mpirun launcher as a batch/v1 Job. backoffLimit 0: a failure restarts the whole gang
    (runPolicy.backoffLimit, counted by the operator), never the launcher alone. With
    runLauncherAsWorker it also runs ranks: a worker's resources and volumes, and a DNS name
    (its own headless Service) for the hostfile. `addresses` (each worker's hostfile name -> its
    pod IP, known once the workers are Ready) become the pod's hostAliases: ssh reaches the
    workers without waiting for cluster DNS to publish them."""
    labels = _labels(job, LAUNCHER, None, attempt)
    volumes, mounts = _ssh_volumes(job)
    ranks: dict = {}
    if job.launcher_as_worker:
        rank_volumes, rank_mounts = _rank_volumes(job, claim_name, labels)
        volumes, mounts = rank_volumes + volumes, rank_mounts + mounts
        ranks = {"hostname": launcher_name(job), "subdomain": launcher_service_name(job)}
    # mpirun forwards the launcher's environment (-x) to every rank: the checkpoint settings too
    container = _container_base(job, LAUNCHER, attempt, resume) | {
        "command": ["sh", "-c", launcher_script(job)],
        "resources": worker_resources(job) if job.launcher_as_worker else dict(job.launcher_resources),
        "volumeMounts": mounts,
    }
    if job.launcher_image:
        container["image"] = job.launcher_image
    if job.launcher_command:
        container["env"] = container["env"] + common.env(launcher_env(job))
    if job.mpi_implementation == "MPICH":
        container["env"] = container["env"] + [
            {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    pod_spec = {**ranks, "restartPolicy": "Never", **_placement(job, LAUNCHER_POD_SET), **NO_TOKEN,
                "securityContext": pod_security_context(job), "containers": [container],
                "volumes": volumes, **_grace(job)}
    if addresses:
        pod_spec["hostAliases"] = [{"ip": ip, "hostnames": [name]} for name, ip in addresses.items()]
    annotations: dict[str, str] = {}
    _ship_logs(job, LAUNCHER, None, attempt, pod_spec, labels, annotations)
    fabric.shape_pod(job, pod_spec, LAUNCHER)
    if job.launcher_as_worker and job.infiniband:  # on the workers' fabric, as they are
        pod_spec["affinity"] = fabric.fabric_affinity(job)
    template_meta: dict = {"labels": dict(labels)}
    if annotations:
        template_meta["annotations"] = annotations
    template = {"metadata": template_meta, "spec": pod_spec}
    podgroup.decorate(job, template_meta, pod_spec)
    overrides.apply(template, job.pod_template.get(LAUNCHER), f"spec.podTemplate.{LAUNCHER}")
    _confine(job, template_meta, pod_spec)
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": common.metadata(launcher_name(job), job.namespace, labels),
        "spec": {"backoffLimit": 0, "template": template},
    }


# The containers of a job's pods that act as its Blob identity: the operator's own code (the
# shipper and the checkpoint fetcher); their names are refused in a pod template.
IDENTITY_CONTAINERS = (logship.SIDECAR, "fetch-checkpoint")
# What the NVIDIA container runtime reads to expose no GPU at all.
NO_GPUS = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}


def _confine(job: Job, metadata: dict, pod_spec: dict) -> None:
    """What holds for every container of the pod, the template's included:
    - with workload identity, the webhook skips every container but the operator's own
      IDENTITY_CONTAINERS (the training container, the preflight, a user's init container or
      sidecar), so no job code gets the federated token;
    - a container without a GPU limit sees no GPU: a CUDA image's own NVIDIA_VISIBLE_DEVICES=all
      (the launcher's, on a GPU node) would otherwise expose every GPU of the node to it. An
      `env` entry beats the image's ENV and any envFrom."""
    containers = pod_spec.get("initContainers", []) + pod_spec["containers"]
    if (metadata.get("labels") or {}).get(blob.WORKLOAD_IDENTITY_LABEL) == "true":
        metadata.setdefault("annotations", {})[blob.WORKLOAD_IDENTITY_SKIP] = ";".join(
            c["name"] for c in containers if c["name"] not in IDENTITY_CONTAINERS)
    for c in containers:
        if not ((c.get("resources") or {}).get("limits") or {}).get(job.placement.gpu_resource):
            c["env"] = [dict(NO_GPUS)] + [e for e in c.get("env") or [] if e["name"] != NO_GPUS["name"]]


def pod_variants(job: Job) -> list[dict]:
    """Every shape of pod the job can have (a pod template is judged against each): each
    worker index that ships or not, a later attempt that fetches a checkpoint, the fallback
    pool's placement, the launcher; a DataStage's claim by a stand-in name."""
    claim = "check" if job.data_stage else None
    jobs = [job] + ([dataclasses.replace(job, placement=job.fallback.placement)]
                    if job.fallback else [])
    fetch = Resume("/output/checkpoints/attempt-0/step-1", fetch="check/0/output/checkpoints")
    out = []
    for j in jobs:
        out += [render_worker(j, i, a, claim_name=claim, resume=r)
                for i in sorted({0, min(1, j.workers - 1)})
                for a, r in ((0, None), (1, fetch if i == 0 and j.checkpoint else None))]
        if j.launcher == "mpi":
            out.append(render_launcher(j, 1, claim_name=claim)["spec"]["template"])
    return out


def check_overrides(job: Job) -> None:
    """SpecError when spec.podTemplate contradicts what the operator renders: the merge of
    render_worker/render_launcher, run once at parse time (spec.parse) on every pod variant the
    job could have (`pod_variants`), so nothing is created for bad input. A name the operator
    gives a container or volume in any variant of a role is refused in that role's template,
    even where this variant lacks it."""
    bare = pod_variants(dataclasses.replace(job, pod_template={}))
    for role, override in job.pod_template.items():
        specs = [p["spec"] for p in bare if _role(p) == role]
        overrides.check_reserved(override, f"spec.podTemplate.{role}",
                                 containers={c["name"] for s in specs
                                             for c in s["containers"] + s.get("initContainers", [])}
                                 | set(IDENTITY_CONTAINERS),
                                 volumes={v["name"] for s in specs for v in s.get("volumes", [])})
    pod_variants(job)


def _role(pod: dict) -> str:
    return pod["metadata"]["labels"][common.LABEL_ROLE]
