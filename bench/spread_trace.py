"""Issue 27: the trainer (or its loader alone) with timing traces, to find what makes the 4-GPU
JPEG runs spread from run to run.

    torchrun ... bench/spread_trace.py TRAINER-ARGS         (TRACE_DIR=folder)
    python bench/spread_trace.py --sample FILE              (the thread sampler, till killed)
    python bench/spread_trace.py --summary TRACE_DIR        (one JSON line per run folder)

Traced, per run, into TRACE_DIR:
  w-<rank>-<pid>.jsonl  one line per batch a loader worker built: wall start/end, the worker's
                        CPU seconds (thread_time), involuntary context switches, the vCPU it ran
                        on at start and end, its worker id.
  r-<rank>.json         the rank's training thread: for every step, when it asked the loader for a
                        batch and when it got it (the data wait); the device-stage thread: when
                        each batch arrived from the DataLoader.
  threads.jsonl         (the sampler) every 0.5 s, each thread of the traced processes: state,
                        vCPU, CPU ticks, so threads sharing a core can be counted.
Knobs (environment), each one suspect's fix, tried without changing the trainer:
  TRACE_IN_ORDER=0      DataLoader(in_order=False): a batch that is ready is taken, whichever
                        worker made it (the default hands batch n to worker n mod W and waits
                        for it in order).
  TRACE_PIN=1           each rank and its workers pinned to its own 1/local-ranks of the CPUs.
  TRACE_RESERVE=K       each rank's own process (training, device-stage, pin and NCCL threads) on
                        K CPUs of its own, its loader workers on the CPUs no rank reserved.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _stat_fields(path: str) -> list[str]:
    with open(path) as f:
        s = f.read()
    return s[s.rindex(")") + 2:].split()  # fields from 3 (state) on


def _processor() -> int:
    return int(_stat_fields("/proc/thread-self/stat")[36])


def _pin() -> None:
    """This rank's slice of the CPUs, whole cores together (siblings listed in sysfs)."""
    local, n = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cpus = sorted(os.sched_getaffinity(0))
    cores: dict[str, list[int]] = {}
    for c in cpus:
        try:
            key = open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read().strip()
        except OSError:
            key = str(c)
        cores.setdefault(key, []).append(c)
    groups = list(cores.values())
    per = len(groups) // n
    mine = {c for g in groups[local * per:(local + 1) * per] for c in g}
    os.sched_setaffinity(0, mine)


def _reserve(k: int) -> set[int]:
    """Pin this process to its K reserved CPUs; return the CPUs left to loader workers."""
    local, n = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cpus[local * k:(local + 1) * k])
    return set(cpus[n * k:])


def trainer(argv: list[str]) -> int:
    if os.environ.get("TRACE_PIN") == "1":
        _pin()
    worker_cpus = _reserve(int(os.environ["TRACE_RESERVE"])) if os.environ.get("TRACE_RESERVE") else None
    import resource
    import threading

    import torch

    from trainop_trainer import cli, torch_data, torch_train

    trace = os.environ["TRACE_DIR"]
    rank = int(os.environ.get("RANK", 0))
    main_pid = os.getpid()
    files: dict[int, object] = {}

    getitem = torch_data.BatchReader.__getitem__

    def traced_getitem(self, key):
        info = torch.utils.data.get_worker_info()
        t0, c0, cpu0 = time.time(), time.thread_time(), _processor()
        sw0 = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
        out = getitem(self, key)
        t1, c1, cpu1 = time.time(), time.thread_time(), _processor()
        sw1 = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
        pid = os.getpid()
        f = files.get(pid)
        if f is None:
            f = files[pid] = open(f"{trace}/w-{rank}-{pid}.jsonl", "a", buffering=1)
        f.write(json.dumps([info.id if info else -1, round(t0, 4), round(t1, 4), round(c1 - c0, 4),
                            sw1 - sw0, cpu0, cpu1, len(key[1])]) + "\n")
        return out

    torch_data.BatchReader.__getitem__ = traced_getitem
    if worker_cpus:
        one_thread = torch_data._one_thread

        def init(worker_id: int) -> None:
            os.sched_setaffinity(0, worker_cpus)
            one_thread(worker_id)

        torch_data._one_thread = init

    steps: list[tuple[float, float]] = []
    arrivals: list[tuple[float, float]] = []
    events: list = []  # a CUDA event at the start of each step, on the training stream
    # 1: the previous step's start marker still pending when this step starts (the CPU over a step
    # ahead of the GPU); 0 in every run of issue 27, so it tells nothing there
    behind: list[int] = []
    nxt, finish, make = torch_data.Loader.__next__, torch_data.Loader._finish, torch_data.Loader._loader

    def mark(t0: float) -> None:
        steps.append((t0, time.time()))
        if torch.cuda.is_available():
            behind.append(int(bool(events) and not events[-1].query()))
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            events.append(e)

    def traced_next(self):
        t0 = time.time()
        item = nxt(self)
        mark(t0)
        return item

    class Traced:
        def __init__(self, it):
            self.it = it

        def __iter__(self):
            return self

        def __next__(self):
            t0 = time.time()
            item = next(self.it)
            mark(t0)
            return item

    synthetic = torch_train._synthetic_batches

    def traced_synthetic(*args, **kwargs):
        it, n = synthetic(*args, **kwargs)
        return Traced(it), n

    torch_train._synthetic_batches = traced_synthetic

    def traced_finish(self, item):
        t0 = time.time()
        out = finish(self, item)
        arrivals.append((t0, time.time()))
        return out

    def loader(self):
        dl = make(self)
        if os.environ.get("TRACE_IN_ORDER") == "0":
            dl.in_order = False
        return dl

    torch_data.Loader.__next__ = traced_next
    torch_data.Loader._finish = traced_finish
    torch_data.Loader._loader = loader
    try:
        return cli.main(argv)
    finally:
        if os.getpid() == main_pid:
            gpu = []
            if events:
                torch.cuda.synchronize()
                gpu = [round(a.elapsed_time(b), 2) for a, b in zip(events, events[1:])]
            with open(f"{trace}/r-{rank}.json", "w") as f:
                json.dump({"rank": rank, "pid": main_pid, "steps": steps, "arrivals": arrivals, "gpuMs": gpu, "behind": behind,
                           "affinity": sorted(os.sched_getaffinity(0)), "threads": threading.active_count()}, f)


def sample(path: str) -> None:
    """Every 0.5 s: [t, [[pid, tid, state, vcpu, ticks], ...]] for the traced processes' threads."""
    mark = ("spread_trace.py", "loader_probe.py")
    cmd: dict[str, bool] = {str(os.getpid()): False}
    with open(path, "a", buffering=1) as out:
        while True:
            t = time.time()
            rows = []
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                if pid not in cmd:
                    try:
                        cmd[pid] = any(m in open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
                                       for m in mark)
                    except OSError:
                        continue
                if not cmd[pid]:
                    continue
                try:
                    tids = os.listdir(f"/proc/{pid}/task")
                except OSError:
                    continue
                for tid in tids:
                    try:
                        f = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
                    except (OSError, ValueError):
                        continue
                    rows.append([int(pid), int(tid), f[0], int(f[36]), int(f[11]) + int(f[12])])
            out.write(json.dumps([round(t, 3), rows]) + "\n")
            time.sleep(max(0.0, 0.5 - (time.time() - t)))


def sysample(path: str) -> None:
    """Every 0.5 s: [t, the aggregate /proc/stat CPU ticks (user nice system idle iowait irq softirq steal)]."""
    with open(path, "a", buffering=1) as out:
        while True:
            t = time.time()
            with open("/proc/stat") as f:
                ticks = [int(x) for x in f.readline().split()[1:9]]
            out.write(json.dumps([round(t, 3), ticks]) + "\n")
            time.sleep(max(0.0, 0.5 - (time.time() - t)))


def _siblings() -> dict[int, int]:
    """vCPU -> physical core id (the first of its siblings)."""
    out = {}
    for c in range(os.cpu_count() or 1):
        try:
            s = open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read().strip()
            first = int(s.replace("-", ",").split(",")[0])
        except (OSError, ValueError):
            first = c
        out[c] = first
    return out


def summary(run_dir: str) -> dict:
    """What one traced run says: per rank, the loader's delivered rate in the timed window vs
    W x its slowest worker's rate, the data wait, and how the workers' CPU went."""
    import glob
    import statistics as st

    ranks = {}
    for p in glob.glob(f"{run_dir}/r-*.json"):
        r = json.load(open(p))
        ranks[r["rank"]] = r
    if not ranks:
        return {"run": run_dir, "error": "no rank traces"}
    # The timed window: the trainer times epochs 2..E; take the last two thirds of the steps.
    res = {"run": os.path.basename(run_dir), "ranks": {}}
    core = _siblings()
    for rank, r in sorted(ranks.items()):
        steps = r["steps"]
        n = len(steps)
        lo = n // 3
        t0, t1 = steps[lo][0], steps[-1][1]
        wait = sum(b - a for a, b in steps[lo:])
        arr = [a for a, _ in r["arrivals"] if t0 <= a <= t1]
        workers = {}
        for wp in glob.glob(f"{run_dir}/w-{rank}-*.jsonl"):
            rows = [json.loads(line) for line in open(wp)]
            rows = [x for x in rows if x[1] >= t0 - 2 and x[2] <= t1]
            if not rows:
                continue
            wall = sum(x[2] - x[1] for x in rows)
            cpu = sum(x[3] for x in rows)
            imgs = sum(x[7] for x in rows)
            workers[rows[0][0]] = {
                "batches": len(rows), "batchSeconds": round(wall / len(rows), 3),
                "cpuShare": round(cpu / wall, 3) if wall else None,
                "cpuMsPerImage": round(1000 * cpu / imgs, 3), "nivcsw": sum(x[4] for x in rows),
                "vcpus": sorted({x[5] for x in rows} | {x[6] for x in rows}),
                "cores": sorted({core.get(x[5], x[5]) for x in rows} | {core.get(x[6], x[6]) for x in rows}),
            }
        W = len(workers)
        bs = [w["batchSeconds"] for w in workers.values()]
        batch = int(os.environ.get("BATCH", 256))
        gpu = r.get("gpuMs") or []
        g = sorted(gpu[lo:])  # gpu[k]: GPU time from step k's start marker to step k+1's
        ahead = r.get("behind") or []
        series = [round(9 * batch / (steps[i - 1][1] - steps[i - 10][1])) for i in range(10, n + 1, 10)]
        gseries = [round(10 * batch / (sum(gpu[i - 10:i]) / 1000)) for i in range(10, len(gpu) + 1, 10)]
        res["ranks"][rank] = {
            "steps": n - lo, "seconds": round(t1 - t0, 3),
            "gpuStepMsMedian": g[len(g) // 2] if g else None,
            "gpuStepMsMean": round(sum(g) / len(g), 2) if g else None,
            "cpuAheadFrac": round(sum(ahead[lo:]) / len(ahead[lo:]), 3) if ahead[lo:] else None,
            "rateSeries": series, "gpuRateSeries": gseries,
            "stepRate": round((n - lo) * batch / (t1 - t0), 1),
            "dataWaitFrac": round(wait / (t1 - t0), 3),
            "deliveredRate": round(len(arr) * batch / (t1 - t0), 1),
            "workers": W,
            "workerBatchSecondsMedian": round(st.median(bs), 3) if bs else None,
            "workerBatchSecondsMax": max(bs) if bs else None,
            # what in-order round robin allows: W batches per the slowest worker's batch time
            "inOrderBound": round(W * batch / max(bs), 1) if bs else None,
            "poolBound": round(sum(batch / b for b in bs), 1) if bs else None,
            "cpuShareMin": min((w["cpuShare"] for w in workers.values()), default=None),
            "cpuShareMedian": round(st.median(w["cpuShare"] for w in workers.values()), 3) if workers else None,
            "cpuMsPerImageMedian": round(st.median(w["cpuMsPerImage"] for w in workers.values()), 3) if workers else None,
            "cpuMsPerImageMax": max((w["cpuMsPerImage"] for w in workers.values()), default=None),
            "workersDetail": workers,
        }
    t0 = min(rr["steps"][len(rr["steps"]) // 3][0] for rr in ranks.values())
    t1 = max(rr["steps"][-1][1] for rr in ranks.values())
    sp = f"{run_dir}/sys.jsonl"
    if os.path.exists(sp):
        rows = [json.loads(line) for line in open(sp)]
        rows = [x for x in rows if t0 - 0.5 <= x[0] <= t1 + 0.5]
        if len(rows) > 1:
            d = [b - a for a, b in zip(rows[0][1], rows[-1][1])]
            tot = sum(d) or 1
            res["sys"] = {"busy": round(1 - (d[3] + d[4]) / tot, 3), "steal": round(d[7] / tot, 4),
                          "system": round(d[2] / tot, 3)}
    gp = f"{run_dir}/gpu.csv"
    if os.path.exists(gp):
        import datetime
        clocks, power, reasons, util = [], [], set(), []
        for line in open(gp):
            f = [x.strip() for x in line.split(",")]
            try:
                ts = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc).timestamp()
            except ValueError:
                continue
            if not t0 <= ts <= t1:
                continue
            try:
                clock, watts, busy = int(f[2].split()[0]), float(f[3].split()[0]), int(f[5].split()[0])
            except (ValueError, IndexError):
                pass
            else:
                clocks.append(clock)
                power.append(watts)
                util.append(busy)
            reasons.add(f[6] if len(f) > 6 else "")
        if clocks:
            res["gpu"] = {"smClockMin": min(clocks), "smClockMedian": st.median(clocks), "powerMedian": st.median(power),
                          "utilMedian": st.median(util), "throttle": sorted(reasons)}
    # threads: how many runnable threads per vCPU and per core, during the window
    tp = f"{run_dir}/threads.jsonl"
    if os.path.exists(tp):
        t0 = min(rr["steps"][len(rr["steps"]) // 3][0] for rr in ranks.values())
        t1 = max(rr["steps"][-1][1] for rr in ranks.values())
        samples = [json.loads(line) for line in open(tp)]
        samples = [s for s in samples if t0 <= s[0] <= t1]
        running, over_vcpu, over_core, busy_vcpus = [], [], [], []
        ticks: dict[tuple[int, int], list[int]] = {}
        for _, rows in samples:
            rr = [x for x in rows if x[2] == "R"]
            running.append(len(rr))
            per_v: dict[int, int] = {}
            per_c: dict[int, int] = {}
            for x in rr:
                per_v[x[3]] = per_v.get(x[3], 0) + 1
                per_c[core.get(x[3], x[3])] = per_c.get(core.get(x[3], x[3]), 0) + 1
            over_vcpu.append(sum(v - 1 for v in per_v.values() if v > 1))
            over_core.append(sum(1 for v in per_c.values() if v > 1))
            busy_vcpus.append(len(per_v))
            for x in rows:
                ticks.setdefault((x[0], x[1]), []).append(x[4])
        dur = (samples[-1][0] - samples[0][0]) if len(samples) > 1 else 0
        mains = {r["pid"] for r in ranks.values()}
        busy = sorted(((v[-1] - v[0]) / 100 / dur, pid, tid) for (pid, tid), v in ticks.items() if dur and len(v) > 1)
        res["threads"] = {
            "samples": len(samples),
            "runnableMedian": st.median(running) if running else None,
            "runnableMax": max(running, default=None),
            "vcpusBusyMedian": st.median(busy_vcpus) if busy_vcpus else None,
            "queuedBehindMedian": st.median(over_vcpu) if over_vcpu else None,  # runnable, not running
            "coresWithTwoMedian": st.median(over_core) if over_core else None,
            "rankThreadsCpu": {str(pid): sorted((round(c, 2) for c, p, _ in busy if p == pid), reverse=True)[:8]
                               for pid in mains},
            "cpuAll": round(sum(c for c, _, _ in busy), 1),
        }
    return res


if __name__ == "__main__":
    if sys.argv[1:2] == ["--sample"]:
        sample(sys.argv[2])
    elif sys.argv[1:2] == ["--sys"]:
        sysample(sys.argv[2])
    elif sys.argv[1:2] == ["--summary"]:
        for d in sys.argv[2:]:
            print(json.dumps(summary(d)))
    else:
        sys.exit(trainer(sys.argv[1:]))
