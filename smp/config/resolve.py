"""Resolve a configuration: merge the sources, check every key and cross-key rule, fill defaults.

Sources, lowest precedence first: the dict (or JSON file path) given to ``smp.init``, then the
``SM_HP_MP_PARAMETERS`` environment variable, which overrides key by key as in SMP v1.

Every problem is collected and raised once, as one ``SMPConfigError`` (also a ``ValueError``),
before any process group exists.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from smp.config.rules import Reads, RuleContext, apply_rules
from smp.config.schema import ALIASES, KEYS, KEYS_BY_NAME, Key
from smp.errors import ConfigProblem, SMPConfigError
from smp.pipeline.registry import default_chain

ENV_VAR = "SM_HP_MP_PARAMETERS"


@dataclass(frozen=True)
class PipelineSection:
    """What the scheduler needs from the configuration (STYLE.md habit 6)."""

    num_stages: int
    num_microbatches: int
    active_microbatches: int | None
    schedule: str
    virtual_stages: int


@dataclass(frozen=True)
class PartitionSection:
    """What the partitioner needs from the configuration."""

    num_stages: int
    auto_partition: bool
    default_partition: int | None
    memory_weight: float
    optimize: str
    contiguous: bool
    virtual_stages: int
    stage_ranks: tuple[int, ...]
    """The rank of each chain part in order (`smp.pipeline.registry.default_chain`: the V for
    ``zb_v``, else the loop ``0 .. p-1`` repeated ``virtual_stages`` times)."""
    microbatches: int
    memory_per_rank: int | None = None
    """Bytes a rank may use for the model (the ``memory_per_rank`` key), or None for no limit."""


class Config:
    """A resolved, validated configuration. Read keys as attributes: ``cfg.microbatches``.

    Example:
        >>> cfg = resolve({"partitions": 2, "microbatches": 4}, world_size=2)
        >>> cfg.pipeline_parallel_degree, cfg.active_microbatches, cfg.memory_weight
        (2, 4, 0.2)
    """

    __slots__ = ("_values", "notes", "world_size", "given")

    def __init__(self, values: Mapping[str, Any], notes: list[str], world_size: int | None,
                 given: frozenset[str] = frozenset()) -> None:
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "notes", list(notes))
        object.__setattr__(self, "world_size", world_size)
        # The keys the user set (dict, file or environment), as opposed to defaults.
        object.__setattr__(self, "given", frozenset(given))

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        if name in ALIASES:
            return values[ALIASES[name]]
        raise AttributeError(f"no configuration key {name!r}{_suggest(name)}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a resolved Config is read-only; pass a new dict to smp.init instead")

    def __getitem__(self, name: str) -> Any:
        return self.__getattr__(name)

    def __contains__(self, name: object) -> bool:
        return name in self._values or name in ALIASES

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def __repr__(self) -> str:
        return f"Config({self._values!r})"

    @property
    def rdp_size(self) -> int:
        world = self.world_size or self.pipeline_parallel_degree * self.tensor_parallel_degree
        return int(world // (self.pipeline_parallel_degree * self.tensor_parallel_degree))

    def pipeline_section(self) -> PipelineSection:
        # The pp + 2 default cap belongs to SMP v1's schedules; the peers' schedules have their own
        # in-flight counts, capped only when the user asks.
        smp_v1 = self.pipeline in ("simple", "interleaved", "_only_forward")
        active = self.active_microbatches if smp_v1 or "active_microbatches" in self.given else None
        return PipelineSection(
            num_stages=self.pipeline_parallel_degree,
            num_microbatches=self.microbatches,
            active_microbatches=active,
            schedule=self.pipeline,
            virtual_stages=self.virtual_stages,
        )

    def partition_section(self) -> PartitionSection:
        return PartitionSection(
            num_stages=self.pipeline_parallel_degree,
            auto_partition=self.auto_partition,
            default_partition=self.default_partition,
            memory_weight=float(self.memory_weight),
            optimize=self.optimize,
            contiguous=self.contiguous,
            virtual_stages=self.virtual_stages,
            stage_ranks=default_chain(self.pipeline, self.pipeline_parallel_degree, self.virtual_stages),
            microbatches=self.microbatches,
            memory_per_rank=self.memory_per_rank,
        )


def _suggest(name: str) -> str:
    names = [k.name for k in KEYS] + list(ALIASES)
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def load_source(config: Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    """Read the script-side source: a dict, a path to a JSON file, or None."""
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path, encoding="utf-8") as f:
                loaded = json.load(f)
        except FileNotFoundError:
            raise SMPConfigError([ConfigProblem("config", path, "the configuration file does not exist",
                                                "pass a dict or the path of a JSON file")]) from None
        except json.JSONDecodeError as e:
            raise SMPConfigError([ConfigProblem("config", path, f"not valid JSON ({e})",
                                                "write the file as a JSON object of smp keys")]) from None
        config = loaded
    if not isinstance(config, Mapping):
        raise SMPConfigError([ConfigProblem("config", config, "the configuration must be a JSON object / dict",
                                            'pass e.g. {"pipeline_parallel_degree": 2}')])
    return dict(config)


def load_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Read ``SM_HP_MP_PARAMETERS`` (a JSON object) if set."""
    env = os.environ if environ is None else environ
    text = env.get(ENV_VAR)
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SMPConfigError([ConfigProblem(ENV_VAR, text, f"not valid JSON ({e})",
                                            "set it to a JSON object of smp keys")]) from None
    if not isinstance(value, dict):
        raise SMPConfigError([ConfigProblem(ENV_VAR, text, "must be a JSON object",
                                            'set it to e.g. {"partitions": 2}')])
    return value


def _canonical(source: Mapping[str, Any], origin: str, problems: list[ConfigProblem]) -> dict[str, Any]:
    """Rename aliases to their key; flag an alias and its key given with different values."""
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for name, value in source.items():
        if not isinstance(name, str):
            problems.append(ConfigProblem(repr(name), value, "configuration keys are strings", "use the key name"))
            continue
        target = ALIASES.get(name, name)
        if target in out and out[target] != value:
            problems.append(ConfigProblem(
                name, value, f"{origin} gives both {spelled[target]!r}={out[target]!r} and {name!r}={value!r}",
                f"give only {target!r}"))
            continue
        out[target] = value
        spelled[target] = name
    return out


def _type_name(types: tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in types)


def _derived_default(key: Key, resolved: Mapping[str, Any], failed: set[str]) -> tuple[Any, bool]:
    """``key``'s default and whether it was computed from a key in ``failed`` (a stand-in value)."""
    view = Reads(dict(resolved))
    value = key.default_for(view)
    return value, bool(view.read & failed)


def _check_key(key: Key, value: Any, resolved: Mapping[str, Any], failed: set[str],
               problems: list[ConfigProblem]) -> bool:
    if value is None and key.nullable:
        return True
    if type(value) not in key.types:
        extra = " (bool is not accepted as a number, nor a number as a bool)" if (
            isinstance(value, bool) or bool in key.types) else ""
        problems.append(ConfigProblem(key.name, value, f"must be of type {_type_name(key.types)}, got "
                                      f"{type(value).__name__}{extra}", f"write e.g. {key.name}: "
                                      f"{_example(key, value, resolved, failed)!r}"))
        return False
    if key.options is not None and value not in key.options:
        close = difflib.get_close_matches(str(value), [str(o) for o in key.options], n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        problems.append(ConfigProblem(key.name, value, f"allowed values are {', '.join(map(repr, key.options))}",
                                      f"{hint}use one of the allowed values"))
        return False
    if key.low is not None and value < key.low:
        problems.append(ConfigProblem(key.name, value, f"must be >= {key.low:g}", f"use a value >= {key.low:g}"))
        return False
    if key.high is not None and value > key.high:
        problems.append(ConfigProblem(key.name, value, f"must be <= {key.high:g}", f"use a value <= {key.high:g}"))
        return False
    if key.status == "unsupported" and value != key.default_for(resolved):
        problems.append(ConfigProblem(key.name, value, "this feature is not implemented in smp",
                                      f"remove the key or set it to {key.default_for(resolved)!r}"))
        return False
    return True


def _example(key: Key, value: Any, resolved: Mapping[str, Any], failed: set[str]) -> Any:
    """A value of the right type: the user's value converted when that is unambiguous, else the default.

    A default derived from a key that failed (``active_microbatches`` from a bad ``microbatches``)
    is not offered: it would be computed from a stand-in value.
    """
    if key.types[0] is bool and value in (0, 1) and type(value) is int:
        return bool(value)
    if key.types[0] is int and type(value) is float and value.is_integer():
        return int(value)
    if key.types[0] is int and type(value) is str and value.strip().isdigit():
        return int(value)
    try:
        default, tainted = _derived_default(key, resolved, failed)
    except KeyError:  # the default reads a key declared below this one: no default to offer
        default, tainted = None, True
    if default is not None and not tainted:
        return default
    if key.options:
        return key.options[0]
    return {bool: True, int: 1, float: 1.0, str: "..."}[key.types[0]]


def resolve(
    config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    world_size: int | None = None,
    framework: str = "torch",
) -> Config:
    """Merge the sources, validate everything, fill the defaults.

    Args:
        config: the script's dict, or a path to a JSON file, or None.
        environ: environment to read ``SM_HP_MP_PARAMETERS`` from (default ``os.environ``).
        world_size: the number of processes, when known; enables the world-size rules.
        framework: ``"torch"`` or ``"tensorflow"`` (TF takes ``horovod`` for data parallelism).

    Returns:
        The resolved Config; ``Config.notes`` holds the log lines to print once on rank 0.

    Raises:
        SMPConfigError: listing every problem found.
    """
    problems: list[ConfigProblem] = []
    script = _canonical(load_source(config), "the config dict", problems)
    launcher = _canonical(load_env(environ), ENV_VAR, problems)
    merged = {**script, **launcher}
    notes: list[str] = []
    overridden = sorted(k for k in launcher if k in script and script[k] != launcher[k])
    if overridden:
        notes.append(f"{ENV_VAR} overrides the script's value for: {', '.join(overridden)}")

    for name in merged:
        if name not in KEYS_BY_NAME:
            problems.append(ConfigProblem(name, merged[name], f"unknown configuration key{_suggest(name)}",
                                          "remove it or fix its spelling (see `smp config` for every key)"))

    # Keys whose value is not the user's valid one: rejected, given twice with different values, or
    # defaulted from such a key. No rule or derived default may report a problem computed from them.
    failed = {ALIASES.get(p.key, p.key) for p in problems}
    resolved: dict[str, Any] = {}
    given: set[str] = set()
    for key in KEYS:
        if key.name in merged:
            value = merged[key.name]
            if _check_key(key, value, resolved, failed, problems):
                resolved[key.name] = value
                given.add(key.name)
                continue
            failed.add(key.name)
        resolved[key.name], tainted = _derived_default(key, resolved, failed)
        if tainted:
            failed.add(key.name)

    ctx = RuleContext(frozenset(given), world_size, framework, problems, notes)
    apply_rules(resolved, ctx, failed)
    if problems:
        raise SMPConfigError(problems)
    for key in KEYS:
        if key.status == "accepted" and key.name in given and resolved[key.name] != key.default_for(resolved):
            notes.append(f"{key.name}={resolved[key.name]!r} is accepted for compatibility and has no effect in smp")
    return Config(resolved, notes, world_size, frozenset(given))
