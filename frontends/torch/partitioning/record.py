"""The traced costs of an automatic partition, recorded for the next launch of the same model and configuration.

The automatic partition is a function of measured times, and measurements move between launches:
the same script could start with one cut today and another tomorrow (issue 39 saw 2 cuts in 5
launches), and a user comparing two runs compared two partitions. So the first launch records what
it traced (every module's forward and backward time, output bytes, call order) in a small JSON file,
and a launch of the same model, step function, input shapes, configuration and machine reads it back
instead of tracing again: the partition function is deterministic, so the same costs give the same
cut, chain and report in every launch, and the first step skips the trace.

The key (`fingerprint`) covers what the costs depend on: every module's path, class and parameter
shapes and dtypes, the source of every module class and of the step function, the shapes and dtypes
of the first microbatch's tensors, the whole configuration, the world's pipeline layout, torch's
version and the machine (processor, CPU count, accelerator name). Change any of them and the model
is traced again. ``SMP_PARTITION_CACHE=off`` always traces; ``SMP_PARTITION_CACHE=<dir>`` keeps the
records there (default: ``$XDG_CACHE_HOME/smp/partitions``, else ``~/.cache/smp/partitions``).
Only global rank 0 reads and writes it (it traces; the others receive the decision). A record that
cannot be read or written is skipped with a warning: the launch traces as before.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import platform
import tempfile
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from smp.structure import leaves

from .trace import Trace

__all__ = ["CACHE_ENV", "cache_dir", "fingerprint", "load", "save"]

logger = logging.getLogger("smp")

CACHE_ENV = "SMP_PARTITION_CACHE"
_VERSION = 1
_FIELDS = ("order", "time", "output_bytes", "backward_time")


def cache_dir(env: Mapping[str, str] | None = None) -> str | None:
    """Where the records live, or None when ``SMP_PARTITION_CACHE`` turns them off."""
    env = os.environ if env is None else env
    value = env.get(CACHE_ENV, "").strip()
    if value.lower() in ("0", "off", "false", "no", "none"):
        return None
    if value:
        return value
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "smp", "partitions")


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        code = getattr(obj, "__code__", None)
        return repr((code.co_code, code.co_consts)) if code is not None else repr(obj)


def _machine() -> str:
    accel = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return f"{platform.machine()} {platform.processor()} {os.cpu_count()} {accel} torch {torch.__version__}"


def fingerprint(module: nn.Module, cfg: Any, first_microbatch: Any) -> str:
    """The key of ``module``'s record (module docstring); ``first_microbatch`` is the step's `functools.partial`."""
    h = hashlib.sha256()
    classes = {}
    for path, m in module.named_modules():
        classes[f"{type(m).__module__}.{type(m).__qualname__}"] = type(m)
        params = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in m.named_parameters(recurse=False)]
        h.update(repr((path, type(m).__qualname__, params)).encode())
    for name in sorted(classes):
        h.update(name.encode() + _source(classes[name]).encode())
    func = getattr(first_microbatch, "func", first_microbatch)
    h.update(_source(func).encode())
    inputs = (getattr(first_microbatch, "args", ()), getattr(first_microbatch, "keywords", {}))
    h.update(repr([(tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else type(x).__name__
                   for x in leaves(inputs)]).encode())
    h.update(json.dumps(cfg.as_dict(), sort_keys=True, default=repr).encode())
    h.update(_machine().encode())
    return h.hexdigest()[:32]


def _path(key: str, env: Mapping[str, str] | None = None) -> str | None:
    where = cache_dir(env)
    return None if where is None else os.path.join(where, f"{key}.json")


def load(key: str) -> tuple[Trace, str] | None:
    """The recorded trace of ``key`` and its file, or None (no record, records off, unreadable)."""
    path = _path(key)
    if path is None or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("version") != _VERSION:
            return None
        tr = Trace()
        for name in _FIELDS:
            setattr(tr, name, dict(data[name]))
        tr.after, tr.after_backward, tr.last = float(data["after"]), float(data["after_backward"]), data["last"]
        tr.tails = {tuple(k.split("\t", 1)): v for k, v in data["tails"].items()}  # type: ignore[misc]
        return tr, path
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("automatic partition: the recorded costs in %s cannot be read (%s); tracing again", path, e)
        return None


def save(key: str, tr: Trace) -> str | None:
    """Record ``tr`` under ``key`` (a temporary file renamed over the record); its path, or None."""
    path = _path(key)
    if path is None:
        return None
    data = {name: getattr(tr, name) for name in _FIELDS}
    data.update(version=_VERSION, after=tr.after, after_backward=tr.after_backward, last=tr.last,
                tails={f"{a}\t{b}": v for (a, b), v in tr.tails.items()})
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".partition-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
        return path
    except OSError as e:
        logger.warning("automatic partition: cannot record the traced costs in %s (%s); the next launch "
                       "traces again", path, e)
        return None


# --- the durations a static plan is built from ---------------------------------------------------
# The plan of a step (the order of every rank's actions, step.py) is simulated from durations measured
# in the first two steps; recorded beside the traced costs under the same key, a later launch plans
# from the same numbers, so its order is the same too. ``when`` is "recording" (the first step's) or
# "planned" (Note [costs measured again] in step.py); ``chain`` is the microbatch chain they belong to.

Durations = list[dict[tuple[str, int], float]]


def _plan_path(key: str) -> str | None:
    path = _path(key)
    return None if path is None else path[: -len(".json")] + "-plan.json"


def load_durations(key: str, when: str, chain: list[int]) -> Durations | None:
    """Every pipeline rank's recorded action durations for ``when`` and ``chain``, or None."""
    path = _plan_path(key)
    if path is None or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            entry = json.load(f).get(f"{when} {chain}")
        if entry is None:
            return None
        return [{(kind, int(ordinal)): float(v) for kind, ordinal, v in rank} for rank in entry]
    except (OSError, ValueError, TypeError) as e:
        logger.warning("the recorded step durations in %s cannot be read (%s); measuring again", path, e)
        return None


def save_durations(key: str, when: str, chain: list[int], durations: Durations) -> None:
    """Record ``durations`` for ``when`` and ``chain`` beside the partition's costs."""
    path = _plan_path(key)
    if path is None:
        return
    try:
        data: dict[str, Any] = {}
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
        data[f"{when} {chain}"] = [[[kind, ordinal, v] for (kind, ordinal), v in rank.items()] for rank in durations]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".plan-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except (OSError, ValueError) as e:
        logger.warning("cannot record the step durations in %s (%s)", path, e)
