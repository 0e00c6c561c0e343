"""Manual placement bookkeeping: scopes, set_partition, default_partition, auto mode, shared params."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from smp.errors import InvalidPartitionIDError, PartitionError
from smp.partition import ModuleNode, ModuleTree, PartitionScopes


def _tree() -> ModuleTree:
    return ModuleTree([
        ModuleNode("", ("embed", "blocks", "act", "head")),
        ModuleNode("embed", param_bytes=8, shared_groups=frozenset({"tied"})),
        ModuleNode("blocks", ("blocks.0", "blocks.1")),
        ModuleNode("blocks.0", ("blocks.0.fc", "blocks.0.drop")),
        ModuleNode("blocks.0.fc", param_bytes=8),
        ModuleNode("blocks.0.drop"),
        ModuleNode("blocks.1", ("blocks.1.fc",)),
        ModuleNode("blocks.1.fc", param_bytes=8),
        ModuleNode("act"),
        ModuleNode("head", shared_groups=frozenset({"tied"}), compute=1.0),
    ])


def test_nested_scopes_innermost_wins() -> None:
    scopes = PartitionScopes(3, default_partition=0)
    assert scopes.current() is None
    with scopes.partition(1):
        scopes.note_created("blocks")
        with scopes.partition(2):
            assert scopes.current() == 2
            scopes.note_created("blocks.1")
            scopes.note_created("blocks.1.fc")
        assert scopes.current() == 1
        scopes.note_created("blocks.0")
        scopes.note_created("blocks.0.fc")
    assert scopes.current() is None
    part = scopes.resolve(_tree())
    assert part.rank_of("blocks.0.fc") == 1 and part.rank_of("blocks.1.fc") == 2
    assert part.rank_of("embed") == 0 and part.rank_of("head") == 0
    assert part.rank_of("blocks.0.drop") == 1, "parameter-less child follows its parent"
    assert part.rank_of("act") == 0
    assert part.chain() == (0, 1, 2, 0)
    assert part.method == "manual"


def test_scope_restored_after_an_exception() -> None:
    scopes = PartitionScopes(2)
    with pytest.raises(RuntimeError), scopes.partition(1):
        raise RuntimeError("boom")
    assert scopes.current() is None


@pytest.mark.parametrize("index", [2, -1, 1.0, True, "1"])
def test_index_checked_against_pp(index: object) -> None:
    scopes = PartitionScopes(2)
    with pytest.raises(InvalidPartitionIDError, match=r"must be an int in \[0, 2\)") as err:
        with scopes.partition(index):  # type: ignore[arg-type]
            pass
    assert "pipeline_parallel_degree=2" in str(err.value)
    with pytest.raises(InvalidPartitionIDError):
        scopes.assign("embed", index)  # type: ignore[arg-type]
    with pytest.raises(InvalidPartitionIDError, match="default_partition"):
        PartitionScopes(2, default_partition=index)  # type: ignore[arg-type]


def test_set_partition_recurse_and_order() -> None:
    scopes = PartitionScopes(3, default_partition=0)
    scopes.assign("blocks", 2)                      # whole subtree
    scopes.assign("blocks.1", 1, recurse=False)     # later call overrides, only that module
    scopes.note_created("blocks.0.fc", 1)           # creation record is overridden by set_partition
    part = scopes.resolve(_tree())
    assert part.rank_of("blocks.0.fc") == 2
    assert part.rank_of("blocks.1") == 1 and part.rank_of("blocks.1.fc") == 2


def test_set_partition_after_first_step_raises() -> None:
    scopes = PartitionScopes(2)
    scopes.freeze()
    with pytest.raises(PartitionError, match="after the first step"):
        scopes.assign("embed", 1)


def test_unknown_module_in_set_partition() -> None:
    scopes = PartitionScopes(2)
    scopes.assign("nope", 1)
    with pytest.raises(PartitionError, match="'nope', which is not part of the model"):
        scopes.resolve(_tree())


def test_auto_partition_ignores_manual_placement_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    scopes = PartitionScopes(2, auto_partition=True)
    with caplog.at_level(logging.INFO, logger="smp.partition"):
        for _ in range(3):
            with scopes.partition(5):  # out of range, but ignored as in SMP v1
                assert scopes.current() is None
                scopes.note_created("embed")
            scopes.assign("embed", 1)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("smp.partition(...)" in m for m in messages) == 1
    assert sum("set_partition" in m for m in messages) == 1
    with pytest.raises(PartitionError, match="use partition_tree"):
        scopes.resolve(_tree())


def test_shared_parameter_on_two_ranks_names_both_modules() -> None:
    scopes = PartitionScopes(2, default_partition=0)
    scopes.assign("head", 1)
    with pytest.raises(PartitionError) as err:
        scopes.resolve(_tree())
    message = str(err.value)
    assert "'embed' (partition 0)" in message and "'head' (partition 1)" in message
    assert "smp.set_partition" in message


def test_no_default_lists_unplaced_modules() -> None:
    scopes = PartitionScopes(2, default_partition=None)
    scopes.assign("", 0, recurse=False)
    with pytest.raises(PartitionError, match=r"no partition and default_partition is not set: \['embed'"):
        scopes.resolve(_tree())


def test_from_settings_and_rename() -> None:
    @dataclass(frozen=True)
    class Section:
        num_stages: int = 2
        auto_partition: bool = False
        default_partition: int | None = 1

    scopes = PartitionScopes.from_settings(Section())
    with scopes.partition(0):
        scopes.note_created("tmp-42")
    scopes.rename({"tmp-42": "blocks"})
    part = scopes.resolve(_tree())
    assert part.rank_of("blocks.0.fc") == 1 and part.rank_of("blocks") == 0 and part.rank_of("embed") == 1


def test_config_partition_section_satisfies_the_protocol() -> None:
    from smp.config import resolve

    section = resolve({"pipeline_parallel_degree": 2, "auto_partition": False, "default_partition": 1},
                      world_size=2).partition_section()
    scopes = PartitionScopes.from_settings(section)
    assert (scopes.pp_size, scopes.auto_partition, scopes.default_partition) == (2, False, 1)
