"""spec.elastic (docs/elastic.md): the gang's size follows the pool.

- `size_for` is THE size choice (pure): the largest that fits and divides maxWorkers (the
  trainer keeps the global batch as maxWorkers x slots micro-batches, shared evenly), no fewer
  than minWorkers.
- `current`: the job at its size now (status.elastic.workers); everything after it (workers,
  hostfile, torchrun's --nnodes, Kueue's pod set) renders that many workers.
- `shrink`: a gang that waits for nodes (a disruption took workers, the pool has not given them
  back) for spec.elastic.shrinkAfterSeconds restarts with the workers the scheduler did place,
  no fewer than minWorkers.
- `grow`: a shrunk gang whose pool now holds more workers than when it shrank restarts bigger:
  at the trainer's next checkpoint (growAtCheckpoint), or at once (the ranks save on SIGTERM).
- `resize` is the one resize path: a new gang attempt (as restart_gang), never counted against
  backoffLimit, recorded in status.restarts.history (fromWorkers, toWorkers, cause) and in the
  Restarting condition with reason Resized, whose transition is the Resized Event.
"""

from __future__ import annotations

import dataclasses

from trainop import kueue
from trainop.actions import Create
from trainop.jobsync.failures import HISTORY, _compact, attempt, restart_counts
from trainop.jobsync.model import _Plan, _Status, _ts
from trainop.spec import Elastic, Job, allocatable, node_matches

SHRINK, GROW = "CapacityLost", "CapacityReturned"  # the causes in status.restarts.history
RESIZED = "Resized"  # the Restarting condition's reason, hence the Event's


def size_for(fits: int, el: Elastic) -> int | None:
    """The size to run with when `fits` workers fit: the largest that divides maxWorkers, at
    most maxWorkers; None when no such size of at least minWorkers fits. (The trainer splits
    each global batch into maxWorkers x slots micro-batches, each rank taking an equal share:
    3 workers of a maximum of 4 cannot share it, trainop_trainer/elastic.py refuses them.)"""
    return next((size for size in range(min(fits, el.max_workers), el.min_workers - 1, -1)
                 if el.max_workers % size == 0), None)


def current(job: Job, st: _Status) -> Job:
    """The job at the size its current attempt runs with (status.elastic.workers; maxWorkers
    at first, or when the status holds nothing sensible)."""
    el = job.elastic
    if el is None:
        return job
    state = dict(st.data.get("elastic") or {})
    size = state.get("workers")
    if not isinstance(size, int) or isinstance(size, bool) or not el.min_workers <= size <= el.max_workers:
        size = el.max_workers
    state["workers"] = size
    st.data["elastic"] = state
    return job if size == job.workers else dataclasses.replace(job, workers=size)


def largest(job: Job) -> Job:
    """The job at maxWorkers: the shape a reservation is judged by (status.admittedShape), so a
    resize is never taken for an edit of the spec."""
    el = job.elastic
    return job if el is None or job.workers == el.max_workers else \
        dataclasses.replace(job, workers=el.max_workers)


def pool_capacity(job: Job, nodes: list[dict], lost: dict, tainted: tuple[str, ...]) -> int:
    """Workers the pool's usable nodes could hold by their allocatable GPUs (one per node for
    a CPU job): an estimate that ignores other tenants' pods, which is why a grow compares it
    with its value at the shrink rather than with the gang's size."""
    gpu, per = job.placement.gpu_resource, job.gpus_per_worker
    return sum((allocatable(n, gpu) // per) if per else 1 for n in nodes
               if node_matches(n, job.placement.node_selector)
               and n["metadata"]["name"] not in lost and n["metadata"]["name"] not in tainted)


def _capacity(plan: _Plan, job: Job) -> int:
    snap = plan.snap
    return pool_capacity(job, snap.nodes, snap.lost_nodes, snap.tainted_nodes)


def _placed(plan: _Plan, workers: dict[int, dict]) -> int:
    """Workers of this attempt the scheduler placed on a node that is not lost."""
    return sum(1 for p in workers.values()
               if (node := (p.get("spec") or {}).get("nodeName"))
               and node not in plan.snap.lost_nodes and not p["metadata"].get("deletionTimestamp"))


def shrink(plan: _Plan, job: Job, st: _Status, workers: dict[int, dict], since) -> object | None:
    """The gang (not launched) has waited for nodes since `since`: after shrinkAfterSeconds,
    restart with the workers that were placed (size_for); before, a wake-up at that moment.
    None: it goes on waiting."""
    el = job.elastic
    placed = _placed(plan, workers)
    target = size_for(placed, el)
    state = st.data["elastic"]
    if target is None or target >= job.workers:
        state["message"] = (f"{placed}/{job.workers} workers placed, fewer than minWorkers "
                            f"{el.min_workers}: waiting for nodes") if target is None else \
            state.get("message", "")
        return None
    left = el.shrink_after_seconds - (plan.now - since).total_seconds()
    if left > 0:
        state["message"] = (f"{placed}/{job.workers} workers placed: shrinking to {target} in "
                            f"{left:.0f}s unless the pool gives the rest back")
        plan.out.requeue_after = min(left, plan.out.requeue_after or left)
        return None
    return resize(plan, job, st, target, SHRINK,
                  f"the pool placed {placed} of {job.workers} workers within "
                  f"shrinkAfterSeconds={el.shrink_after_seconds}", fits=placed)


def grow(plan: _Plan, job: Job, st: _Status) -> object | None:
    """A running gang below maxWorkers: once its pool holds more workers than when it shrank,
    restart bigger (at the next checkpoint with growAtCheckpoint). None: it runs on."""
    el, state = job.elastic, st.data["elastic"]
    if el is None or job.workers >= el.max_workers:
        return None
    have = _capacity(plan, job)
    if state.get("pool", job.placement.pool) != job.placement.pool:
        # moved to another pool since the shrink (nodePool.fallback): judged by its own nodes
        state.update(capacity=job.workers, fits=job.workers, pool=job.placement.pool)
    was = state.setdefault("capacity", have)  # (a status from before it was kept)
    # what fitted at the shrink (more than the size when size_for rounded it down), plus what
    # the pool gained since
    target = size_for(state.get("fits", job.workers) + max(have - was, 0), el)
    if target is None or target <= job.workers:
        if state.pop("growTo", None) is not None:  # the capacity went again before the save
            state.pop("growAfterStep", None)
            state["message"] = f"the pool's new room went again: running on at {job.workers}"
        return None
    why = f"the pool holds {have - was} more worker(s) than when the gang shrank"
    queued = _kueue_admits(plan, job, st, target)
    if queued:  # the gang runs on at its size meanwhile
        state.update(growTo=target, message=f"{why}: {queued}")
        state.setdefault("growAfterStep", _step(st))
        return None
    if not el.grow_at_checkpoint:
        return resize(plan, job, st, target, GROW, f"{why} (growAtCheckpoint false: the ranks "
                      f"save on SIGTERM)")
    step = _step(st)
    after = state.setdefault("growAfterStep", step)
    if step <= after:
        state.update(growTo=target, message=f"{why}: growing to {target} workers at the next "
                                            f"checkpoint (after step {after})")
        return None
    return resize(plan, job, st, target, GROW, f"{why}; checkpoint step {step} saved")


def _step(st: _Status) -> int:
    """The step of the checkpoint the next attempt would resume from (-1: none yet)."""
    step = (st.data.get("checkpoint") or {}).get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else -1


def _kueue_admits(plan: _Plan, job: Job, st: _Status, target: int) -> str | None:
    """None when the gang may grow to `target` as far as Kueue is concerned; else what it waits
    for. With workload slices (config kueue.workloadSlices) a count beyond the admitted one goes
    through Kueue's admission first: a Workload slice of `target` workers that names the one
    it replaces (created here once); Kueue admits it counting the old one's quota as its own
    and finishes the old one. Without slices the resize itself replaces the Workload
    (queueing._kueue_workload_stale), which queues for admission at the new size."""
    wl = plan.snap.workload
    if not (plan.snap.kueue and plan.cfg.kueue_workload_slices) or \
            (kueue.admitted(wl) and (kueue.worker_count(wl) or 0) >= target):
        return None
    pending = plan.snap.workload_slice
    name = kueue.slice_name(job.name, attempt(st.data) + 1)
    if pending is None and wl is not None:
        queue = (plan.body.get("spec") or {}).get("queue")
        bigger = dataclasses.replace(job, workers=target, flavors=())  # as the first was rendered
        plan.out.actions.append(Create(kueue.render_workload(
            bigger, queue, plan.prio, plan.snap.memo, slices=True, replaces=wl,
            attempt=attempt(st.data) + 1), plan.body))
    elif pending is not None:
        name = pending["metadata"]["name"]
    return f"waiting for Kueue to admit Workload slice {name} for {target} workers"


def resize(plan: _Plan, job: Job, st: _Status, to: int, cause: str, why: str,
           fits: int | None = None) -> object:
    """THE resize path: attempt + 1 at `to` workers (later reconciles delete the old attempt's
    pods, then create the new ones, which resume from status.checkpoint); not counted. `fits`:
    the workers that fitted (`to` or more), what a later grow counts from."""
    counts = restart_counts(st.data)
    counts["resizes"] += 1
    next_attempt = attempt(st.data) + 1
    verb = "shrinking" if to < job.workers else "growing"
    message = f"{why}: {verb} the gang from {job.workers} to {to} workers as attempt {next_attempt}"
    counts["history"] = (counts["history"] + [{
        "attempt": next_attempt, "time": _ts(plan.now), "cause": cause, "counted": False,
        "fromWorkers": job.workers, "toWorkers": to, "message": message}])[-HISTORY:]
    st.data["restarts"] = _compact(counts)
    st.data["attempt"] = next_attempt
    state = {"workers": to, "message": message}
    if to < job.elastic.max_workers:  # what a later grow compares the pool with
        state["capacity"] = _capacity(plan, job)
        state["fits"] = to if fits is None else fits
        if job.placement.pool:
            state["pool"] = job.placement.pool
    st.data["elastic"] = state
    st.cond("Restarting", True, RESIZED, message)
    # The other conditions' transitions say Resizing: the one Resized Event is Restarting's.
    st.cond("WorkersReady", False, "Resizing", "the gang is being recreated at another size")
    if st.is_true("WaitingForNodes"):
        st.cond("WaitingForNodes", False, "Resizing", "the gang is being recreated at another size")
    if st.is_true("Running"):
        st.cond("Running", False, "Resizing", message)
    st.phase("Starting")
    return plan.wait(message)
