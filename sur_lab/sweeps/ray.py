"""The Ray scheduler: the cases of a sweep spread over actors on one machine or a cluster.

``run_sweep(lm, cases, methods, budgets, out_dir, workers=4)`` (or ``address="auto"`` / ``"ray://head:10001"``) lands
here. Each Ray actor loads the model once from the same :func:`sur_lab.models.load_model` arguments, pins its torch
threads, and runs whole cases with :func:`sur_lab.sweeps.case.run_case`, handing each record to the same
:class:`sur_lab.sweeps.store.SweepStore` (``parts/<case>.jsonl``) as a local run, so a case's records are the ones a
local run makes. The driver keeps the queue (longest case first: context tokens x records still to do), shows one
progress bar over records (it counts the lines of the part files), re-queues the case of an actor that died (its
finished records stay; the new actor resumes the case from its part file), and consolidates ``records.parquet`` as the
local scheduler does. The driver holds the folder's lock for the whole run.

``out_dir`` must be a directory every actor can reach: a local path on one machine, a shared filesystem path (NFS,
Lustre, a mounted bucket with POSIX appends) on a cluster. Every node needs sur_lab and the model installed.

Timing honesty: every record carries ``workers`` (concurrent actors) and ``threads`` (torch intra-op threads of the
process that made it). Latency studies should run with one worker; :func:`sur_lab.analysis.stats.check_concurrency`
refuses to pool timings made under different settings.

Ray is an optional dependency (``pip install -e '.[distributed]'``; ``make install`` includes it). Importing this
module does not import Ray; only running with ``workers > 1`` or an ``address`` does.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

from sur_lab.models import EMBEDDED_MODEL, LoadedModel, embedded_model, load_model
from sur_lab.sweeps.case import Case, grid_keys, run_case, shared_prefix
from sur_lab.sweeps.record import config_fields
from sur_lab.sweeps.store import SweepStore, check_fingerprint
#: How often the driver refreshes the progress bar while waiting for cases, seconds.
POLL_S = 0.5
#: How many times one case is re-queued after the actor running it died, before the sweep gives up on it.
MAX_CASE_RETRIES = 2

#: Process ids of the actors of the sweep running in this driver (diagnostics, e.g. a benchmark that kills one).
_WORKER_PIDS: list[int] = []

INSTALL_HINT = "pip install -e '.[distributed]' (or pip install ray; make install includes it)"


def worker_pids() -> list[int]:
    """Process ids of the Ray actors started by the sweep now running in this process (empty when none): for
    diagnostics and fault-injection benchmarks (``scripts/bench_sweep_workers.py`` kills one)."""
    return list(_WORKER_PIDS)


def require_ray():
    """Import and return Ray, or raise ImportError with the install command."""
    try:
        import ray
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(f"workers > 1 or address= needs Ray, which is not installed: {INSTALL_HINT}") from err
    return ray


def check_workers(workers: Any, address: Any = None, threads: Any = None) -> None:
    """Refuse bad ``workers`` / ``address`` / ``threads`` values (before any work).

    Args:
        workers: number of Ray actors, an int >= 1 (booleans refused).
        address: ``None`` (start a local Ray instance), ``"local"`` (same), ``"auto"`` (join the cluster this machine
            belongs to), ``"ray://host:port"`` (Ray client) or ``"host:port"`` (a head node's GCS address).
        threads: torch threads per actor, an int >= 1, or ``None`` for the default.

    Raises:
        ValueError: naming the argument and the allowed values.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1; got {workers!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be an integer >= 1 or None (default: cores // workers); got {threads!r}")
    if address is None or address in ("auto", "local"):
        return
    if not isinstance(address, str):
        raise ValueError(f"address must be None, 'auto', 'local', 'ray://host:port' or 'host:port'; got {address!r}")
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if "://" in rest or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"address must be None, 'auto', 'local', 'ray://host:port' or 'host:port' (port 1-65535); got {address!r}"
        )


def check_local_gpus(model_args: Mapping, workers: int, address: str | None, available: int | None = None) -> None:
    """Refuse a local CUDA sweep with more actors than GPUs (each actor reserves one; the rest would wait forever).

    Args:
        model_args: :func:`model_args_of` result; only ``device`` is read.
        workers: Ray actors.
        address: as in :func:`check_workers`; a cluster (``"auto"``, ``ray://...``) is not checked here.
        available: GPUs on this machine (default ``torch.cuda.device_count()``).

    Raises:
        ValueError: naming ``workers``, the device and the GPU count, before Ray starts.
    """
    device = str(model_args.get("device", "cpu"))
    if not device.startswith("cuda") or address not in (None, "local"):
        return
    if available is None:
        available = torch.cuda.device_count()
    if workers > available:
        raise ValueError(
            f"workers={workers} with device={device!r}: each Ray actor reserves one GPU and this machine has "
            f"{available}; use workers <= {max(available, 1)} (e.g. -p workers 1 for a notebook on one GPU)"
        )


def model_args_of(lm: Any) -> dict:
    """The :func:`sur_lab.models.load_model` keyword arguments that reload ``lm`` in another process.

    A :class:`sur_lab.models.LoadedModel` is described by its spec's name (hub id, local path or the embedded model's
    name), dtype and device; a mapping is returned as a dict (it *is* the arguments). Models built in memory (e.g.
    :func:`sur_lab.models.wrap_model` on a random model) cannot be described: save them with ``save_pretrained`` and
    pass ``model_args={"name": that_directory}``.

    Raises:
        ValueError: if ``lm`` is neither a mapping with a ``name`` key nor a LoadedModel.
    """
    if isinstance(lm, Mapping):
        if "name" not in lm:
            raise ValueError(f"model_args must hold the load_model arguments, including 'name'; got keys {sorted(lm)}")
        return dict(lm)
    if isinstance(lm, LoadedModel):
        name = None if lm.spec.name == EMBEDDED_MODEL else lm.spec.name
        return {"name": name, "dtype": str(lm.spec.dtype).removeprefix("torch."), "device": lm.spec.device}
    raise ValueError(f"lm must be a LoadedModel or a mapping of load_model arguments; got {type(lm).__name__}")


def model_label(model_args: Mapping) -> str:
    """The ``model`` field a model loaded from ``model_args`` will have (``ModelSpec.name``)."""
    name = model_args.get("name")
    em = embedded_model(name)
    return em.label if em is not None else str(name)


def default_threads(workers: int, cores: int) -> int:
    """Torch threads per actor: ``max(1, cores // workers)``."""
    return max(1, int(cores) // int(workers))


class _CaseRunner:
    """One Ray actor's state: the model, loaded once, and the pinned thread count (wrapped by ``ray.remote``)."""

    def __init__(self, model_args: Mapping, threads: int, workers: int) -> None:
        hf_logging.disable_progress_bar()  # the driver draws the one progress bar
        torch.set_num_threads(int(threads))
        self.lm = load_model(**dict(model_args))
        self.workers = int(workers)

    def describe(self) -> dict:
        return {"pid": os.getpid(), "model": self.lm.spec.name, "threads": torch.get_num_threads()}

    def run(self, case: Case, methods, budgets, out_dir: str, case_args: dict, timed: bool) -> tuple[str, int]:
        """Run the records of ``case`` still missing from its part file; returns ``(case_id, records written)``."""
        store = SweepStore(out_dir)
        stored = store.read(case.case_id, case.meta.keys())
        # The full fingerprint (weights hash, dtype, device, options, versions) needs the model: checked here, on
        # the actor that holds it, against every stored record of the case before any work.
        config = config_fields(self.lm, **{k: case_args[k] for k in ("seed", "executor", "max_new_tokens",
                                                                       "eval_batch", "options")})
        per_request = timed or config["eval_batch"] == 1
        expected = {**config, "case_fingerprint": case.fingerprint(), "timed": per_request,
                    "shared_prefix": shared_prefix(case_args.get("share_prefix", True), per_request)}
        check_fingerprint(stored.values(), expected, out_dir=out_dir, case_id=case.case_id)
        made = run_case(self.lm, case, methods, budgets, **case_args, timed=timed, skip=set(stored),
                        emit=store.append, workers=self.workers)
        return case.case_id, len(made)


def init_ray(address: str | None = None, *, num_cpus: int | None = None, attempts: int = 3):
    """``ray.init`` for sweeps (no dashboard, workers' logs shown), retried when a busy machine makes the local node miss
    Ray's start-up deadline (its raylet waits a fixed time for the dashboard agent; ray-project/ray#65983).

    A local instance starts its workers at the driver's niceness (``worker_niceness`` 0; Ray's default adds
    15, so any other process on the machine, a second notebook included, takes the sweep's cores: a two-worker
    NIAH sweep beside one notebook at niceness 0 was starved, its workers at 50 % CPU each). A cluster reached by
    ``address`` keeps its own setting.

    Args:
        address: ``None``/``"local"`` start a local instance; anything else is passed to ``ray.init(address=...)``.
        num_cpus: CPUs a local instance offers (default: Ray's count).
        attempts: start-up tries (>= 1).
    """
    ray = require_ray()
    kwargs: dict[str, Any] = {"configure_logging": False, "log_to_driver": True}
    if address in (None, "local"):
        kwargs.update(include_dashboard=False, num_cpus=num_cpus, _system_config={"worker_niceness": 0})
    else:
        kwargs["address"] = address
    for attempt in range(1, attempts + 1):
        try:
            return ray.init(**kwargs)
        except Exception as err:  # noqa: BLE001 - Ray raises a bare Exception for a start-up timeout
            if "timed out during startup" not in str(err) or attempt == attempts:
                raise
            ray.shutdown()


def _connect(ray, address: str | None, workers: int, threads: int | None):
    """Start or join Ray; returns ``(started_here, cores)`` where cores is the CPUs Ray offers."""
    if ray.is_initialized():
        started = False
    elif address in (None, "local"):
        cores = os.cpu_count() or 1
        need = workers * (threads or 1)
        # A local instance offers at least one CPU per actor thread, so actors never wait for resources that an
        # oversubscribed small machine lacks (their timings then say so through `workers` and `threads`).
        init_ray(address, num_cpus=max(cores, need))
        started = True
    else:
        init_ray(address)
        started = True
    cores = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
    if not started and address in (None, "local"):
        cores = min(cores, os.cpu_count() or cores)
    return started, cores


def run_ray(
    lm: Any,
    cases: Sequence[Case],
    methods: Sequence[str],
    budgets: Sequence[float],
    store: SweepStore,
    *,
    case_args: Mapping[str, Any],
    timed: frozenset[str],
    manifest: Mapping[str, Any],
    workers: int = 2,
    address: str | None = None,
    threads: int | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Run every case's missing records on ``workers`` Ray actors; returns the consolidated records (same rows, order
    and fields as a local run; ``workers`` and ``threads`` say how they were measured).

    Args:
        lm: a :class:`sur_lab.models.LoadedModel` (its name, dtype and device are reloaded in every actor, see
            :func:`model_args_of`) or a mapping of :func:`sur_lab.models.load_model` keyword arguments, e.g.
            ``{"name": None}`` for the embedded model or ``{"name": "/shared/tiny", "dtype": "float64"}`` (the driver
            then loads no model at all).
        cases, methods, budgets, store, case_args, timed, manifest, progress: as
            :func:`sur_lab.sweeps.local.run_local`; ``case_args`` (its ``scorer``, ``parser`` and ``options``) is
            pickled to the actors (module-level functions are best).
        workers: Ray actors (>= 1); each holds one model copy.
        address: ``None``/``"local"``: a local Ray instance on this machine; ``"auto"``: the running cluster;
            ``"ray://host:10001"`` or ``"host:6379"``: a remote one. Ignored when Ray is already initialized.
        threads: torch threads per actor; default ``max(1, CPUs // workers)``. On a CUDA model (``device`` starting
            with ``"cuda"``) each actor also reserves one GPU.

    Raises:
        ValueError: for bad ``workers``/``address``/``threads``, or stored records made with another configuration
            (the fields the driver knows, before any actor starts; the rest on the actor, before its case's work);
            also when an actor loads a model whose name differs from the one the records are keyed by.
        ImportError: with the install command, when Ray is missing.
        RuntimeError: when one case killed its actor more than :data:`MAX_CASE_RETRIES` times, or another process is
            sweeping into the folder.
    """
    check_workers(workers, address, threads)
    model_args = model_args_of(lm)
    check_local_gpus(model_args, workers, address)
    ray = require_ray()
    keys = grid_keys(methods, budgets)
    ids = [c.case_id for c in cases]
    eval_batch = int(case_args["eval_batch"])
    # The fingerprint fields the driver knows without the model; the actors check the whole fingerprint.
    known = {"model": model_label(model_args), "seed": int(case_args["seed"]), "executor": case_args["executor"],
             "max_new_tokens": int(case_args["max_new_tokens"]), "eval_batch": eval_batch}
    with store.lock():
        store.adopt_consolidated(known)  # before anything can overwrite a records.parquet without parts
        stored = {c.case_id: store.read(c.case_id, c.meta.keys()) for c in cases}
        for case in cases:
            per_request = case.case_id in timed or eval_batch == 1
            expected = {**known, "case_fingerprint": case.fingerprint(), "timed": per_request,
                        "shared_prefix": shared_prefix(case_args.get("share_prefix", True), per_request)}
            check_fingerprint(stored[case.case_id].values(), expected, out_dir=store.out_dir, case_id=case.case_id)
        store.write_manifest(known, **manifest, workers=workers, address=address)
        todo = {c.case_id: sum(k not in stored[c.case_id] for k in keys) for c in cases}
        by_id = {c.case_id: c for c in cases}
        # Longest first: the case with the most work (context tokens x records left) starts first.
        queue = sorted((c for c in cases if todo[c.case_id]),
                       key=lambda c: -len(c.edit.original_ids) * todo[c.case_id])
        total = len(cases) * len(keys)
        seen = {cid: len(keys) - n for cid, n in todo.items()}  # finished records per case, never decreasing
        bar = tqdm(total=total, initial=total - sum(todo.values()), disable=not progress, desc="sweep", unit="record")
        started = False
        actors: list = []
        try:
            if queue:
                started, cores = _connect(ray, address, workers, threads)
                n_threads = threads or default_threads(workers, cores)
                on_gpu = str(model_args.get("device", "cpu")).startswith("cuda")
                remote_cls = ray.remote(_CaseRunner).options(
                    num_cpus=n_threads if address not in (None, "local") else 1,
                    num_gpus=1 if on_gpu else 0, max_restarts=0, max_concurrency=1,
                )

                def new_actor():
                    return remote_cls.remote(model_args, n_threads, workers)

                actors = [new_actor() for _ in range(min(workers, len(queue)))]
                for info in ray.get([a.describe.remote() for a in actors]):
                    _WORKER_PIDS.append(info["pid"])
                    if info["model"] != known["model"]:
                        raise ValueError(
                            f"model_args load a model named {info['model']!r}, but records are keyed by "
                            f"{known['model']!r}; pass model_args whose 'name' is the model's hub id or path"
                        )
                retries: dict[str, int] = {}
                running: dict[Any, tuple[Any, str]] = {}  # object ref -> (actor, case id)
                idle = list(actors)
                finished = total - sum(todo.values())
                args = dict(case_args)
                while queue or running:
                    while queue and idle:
                        actor, case = idle.pop(), queue.pop(0)
                        ref = actor.run.remote(case, list(methods), list(budgets), str(store.out_dir), args,
                                               case.case_id in timed)
                        running[ref] = (actor, case.case_id)
                    ready, _ = ray.wait(list(running), num_returns=1, timeout=POLL_S)
                    for ref in ready:
                        actor, cid = running.pop(ref)
                        try:
                            ray.get(ref)
                        except ray.exceptions.RayActorError:
                            retries[cid] = retries.get(cid, 0) + 1
                            if retries[cid] > MAX_CASE_RETRIES:
                                raise RuntimeError(
                                    f"case {cid!r} killed its Ray actor {retries[cid]} times (out of memory?); its "
                                    f"finished records are kept in {store.part_path(cid)}"
                                ) from None
                            actors.remove(actor)
                            actor = new_actor()
                            actors.append(actor)
                            queue.insert(0, by_id[cid])  # re-queued; its finished records are not recomputed
                        except ray.exceptions.RayTaskError as err:
                            raise err.as_instanceof_cause() from None
                        else:
                            seen[cid] = len(keys)
                        idle.append(actor)
                    for _, cid in running.values():  # records of cases in flight (a re-queued case keeps its count)
                        seen[cid] = max(seen[cid], min(len(keys), store.count(cid)))
                    now = sum(seen.values())
                    if now > finished:
                        bar.update(now - finished)
                        finished = now
                    if running:
                        bar.set_postfix_str(f"{len(running)} running, {len(queue)} queued")
        finally:
            bar.close()
            _WORKER_PIDS.clear()
            for actor in actors:
                try:
                    ray.kill(actor)
                except Exception:  # noqa: BLE001 - an actor that is already gone
                    pass
            if started:
                ray.shutdown()
        return store.consolidate(ids, keys)


def records_per_minute(records: pd.DataFrame, seconds: float) -> float:
    """Throughput of a sweep: records / minute (NaN for a non-positive duration)."""
    return len(records) / (seconds / 60.0) if seconds > 0 else math.nan


__all__ = [
    "INSTALL_HINT", "MAX_CASE_RETRIES", "check_local_gpus", "check_workers", "default_threads", "init_ray",
    "model_args_of", "model_label", "records_per_minute", "require_ray", "run_ray", "worker_pids",
]
