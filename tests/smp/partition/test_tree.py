"""Automatic partitioning of module trees: optimality, constraints, chain, virtual stages, memory caps."""

from __future__ import annotations

import dataclasses
import random

import pytest

from smp.errors import PartitionError, PartitionMemoryError
from smp.partition import ModuleNode, ModuleTree, TreePartition, partition_tree
from tests.smp.partition.builders import brute_force, chain_tree, random_tree, reference_chain


def _rank_compute(part: TreePartition) -> list[float]:
    return [t.compute for t in part.rank_totals()]


def test_chain_of_blocks_is_exact() -> None:
    rng = random.Random(1)
    for _ in range(150):
        n = rng.randint(2, 12)
        p = rng.randint(1, min(4, n))
        costs = [float(rng.randint(1, 9)) for _ in range(n)]
        part = partition_tree(chain_tree(costs), p, memory_weight=0.0)
        assert max(_rank_compute(part)) == brute_force(costs, p)[0]
        assert part.chain() == tuple(range(p)), "one contiguous piece per rank"


def test_random_trees_within_5_percent_of_best_leaf_split() -> None:
    rng = random.Random(2)
    worst = 1.0
    for trial in range(120):
        tree, leaves, compute = random_tree(rng, rng.randint(4, 30))
        p = rng.randint(2, min(8, len(leaves)))
        part = partition_tree(tree, p, memory_weight=0.0)
        best = reference_chain([compute[leaf] for leaf in leaves], p)
        ratio = max(_rank_compute(part)) / best
        worst = max(worst, ratio)
        assert ratio <= 1.05 + 1e-9, (trial, ratio)
        # Contiguous in execution order: the chain visits each rank once, in order.
        assert part.chain() == tuple(range(p))
    assert worst >= 1.0


def test_random_trees_with_own_costs_and_parameterless_leaves() -> None:
    rng = random.Random(3)
    for _ in range(60):
        tree, leaves, _ = random_tree(rng, rng.randint(4, 20), paramless=0.3, own_cost=0.3)
        p = rng.randint(2, min(4, len(leaves)))
        part = partition_tree(tree, p, memory_weight=0.5)
        for node in tree:
            parent = tree.parent(node.path)
            if parent is not None and tree.is_parameterless(node.path):
                assert part.rank_of(node.path) == part.rank_of(parent), "parameter-less modules run with their parent"
        assert set(part.assignment.values()) == set(range(p)), "every rank gets work"


def test_shared_parameters_always_together() -> None:
    rng = random.Random(4)
    for _ in range(80):
        tree, leaves, _ = random_tree(rng, rng.randint(5, 20))
        shared = rng.sample(leaves, rng.randint(2, 3))
        nodes = [ModuleNode(n.path, n.children, n.param_bytes if n.path != shared[-1] else 0, n.activation_bytes,
                            n.compute, frozenset({"tied"}) if n.path in shared else frozenset(), n.param_count)
                 for n in tree]
        tied = ModuleTree(nodes)
        p = rng.randint(2, 4)
        part = partition_tree(tied, p, memory_weight=rng.choice([0.0, 0.2, 0.8]))
        assert len({part.rank_of(s) for s in shared}) == 1, shared


def _lm(layers: int, *, tied: bool, embed_bytes: int = 400) -> ModuleTree:
    group = frozenset({"wte"}) if tied else frozenset()
    return ModuleTree([
        ModuleNode("", ("model", "lm_head")),
        ModuleNode("model", ("model.embed", "model.rotary", "model.layers", "model.norm")),
        ModuleNode("model.embed", param_bytes=embed_bytes, compute=0.5, shared_groups=group, activation_bytes=8),
        ModuleNode("model.rotary", compute=0.1),
        ModuleNode("model.layers", tuple(f"model.layers.{i}" for i in range(layers))),
        *[ModuleNode(f"model.layers.{i}", (f"model.layers.{i}.attn", f"model.layers.{i}.mlp"))
          for i in range(layers)],
        *[ModuleNode(f"model.layers.{i}.attn", param_bytes=100, compute=4.0, activation_bytes=8) for i in range(layers)],
        *[ModuleNode(f"model.layers.{i}.mlp", param_bytes=200, compute=6.0, activation_bytes=8) for i in range(layers)],
        ModuleNode("model.norm", param_bytes=1, compute=0.1, activation_bytes=8),
        ModuleNode("lm_head", param_bytes=0 if tied else embed_bytes, compute=4.0, shared_groups=group,
                   activation_bytes=64),
    ])


def test_tied_embedding_and_head_give_a_return_chain() -> None:
    part = partition_tree(_lm(6, tied=True), 2, memory_weight=0.0)
    assert part.rank_of("model.embed") == part.rank_of("lm_head")
    assert part.chain() in ((0, 1, 0), (1, 0, 1))
    assert part.rank_of("model.rotary") == part.rank_of("model"), "parameter-less child runs with its parent"
    segs = part.segments()
    assert [s.rank for s in segs] == list(part.chain())
    assert segs[-1].items == ("lm_head",)
    assert sum(s.totals.compute for s in segs) == pytest.approx(0.5 + 0.1 + 6 * 10 + 0.1 + 4.0)


def test_untied_model_has_a_straight_chain_and_keeps_layers_whole() -> None:
    part = partition_tree(_lm(8, tied=False), 4, memory_weight=0.0)
    assert part.chain() == (0, 1, 2, 3)
    for i in range(8):
        assert part.rank_of(f"model.layers.{i}.attn") == part.rank_of(f"model.layers.{i}.mlp"), "layers stay whole"


def test_descends_only_when_whole_modules_unbalance() -> None:
    # Two equal halves: no need to open either.
    halves = ModuleTree([
        ModuleNode("", ("a", "b")),
        ModuleNode("a", ("a.0", "a.1")), ModuleNode("a.0", param_bytes=1, compute=5.0),
        ModuleNode("a.1", param_bytes=1, compute=5.0),
        ModuleNode("b", ("b.0", "b.1")), ModuleNode("b.0", param_bytes=1, compute=5.0),
        ModuleNode("b.1", param_bytes=1, compute=5.0),
    ])
    part = partition_tree(halves, 2, memory_weight=0.0)
    assert part.local_paths(0) == ("", "a", "a.0", "a.1") and part.local_paths(1) == ("b", "b.0", "b.1")
    assert "opening 1 module" in part.notes[0]
    # One heavy container between two light leaves: it must be opened.
    heavy = ModuleTree([
        ModuleNode("", ("embed", "layers", "head")),
        ModuleNode("embed", param_bytes=1, compute=1.0),
        ModuleNode("layers", tuple(f"layers.{i}" for i in range(4))),
        *[ModuleNode(f"layers.{i}", param_bytes=1, compute=2.0) for i in range(4)],
        ModuleNode("head", param_bytes=1, compute=1.0),
    ])
    part = partition_tree(heavy, 2, memory_weight=0.0)
    assert _rank_compute(part) == [5.0, 5.0]
    assert part.rank_of("layers") == part.rank_of("layers.0") == 0


def test_virtual_stages_loop_over_the_ranks() -> None:
    costs = [1.0] * 16
    part = partition_tree(chain_tree(costs), 4, memory_weight=0.0, virtual_stages=2)
    assert part.chain() == (0, 1, 2, 3, 0, 1, 2, 3)
    assert _rank_compute(part) == [4.0] * 4
    assert [len(s.items) for s in part.segments()] == [2] * 8


def test_memory_cap_respects_in_flight_counts_and_is_optimal() -> None:
    """1F1B: rank r holds p - r microbatches, so early ranks must take fewer activation-heavy blocks."""
    rng = random.Random(6)
    exercised = 0
    for _ in range(60):
        n = rng.randint(4, 10)
        p = rng.randint(2, min(4, n))
        costs = [float(rng.randint(1, 9)) for _ in range(n)]
        acts = [rng.randint(1, 9) for _ in range(n)]
        tree = chain_tree(costs, acts=acts)
        in_flight = [p - r for r in range(p)]
        cap = float(rng.randint(10, 60))

        def fits(k: int, i: int, j: int, acts: list[int] = acts, in_flight: list[int] = in_flight,
                 cap: float = cap) -> bool:
            return in_flight[k] * sum(acts[i:j]) <= cap

        best = brute_force(costs, p, fits)[0]
        # param_memory_factor=0: memory is the activations only, as in `fits`.
        kwargs = {"memory_cap_bytes": cap, "in_flight": in_flight, "param_memory_factor": 0.0}
        if best == float("inf"):
            with pytest.raises(PartitionMemoryError, match="memory_cap_bytes"):
                partition_tree(tree, p, memory_weight=0.0, **kwargs)  # type: ignore[arg-type]
            continue
        part = partition_tree(tree, p, memory_weight=0.0, **kwargs)  # type: ignore[arg-type]
        assert max(part.memory_bytes()) <= cap
        assert max(_rank_compute(part)) == best
        exercised += 1
    assert exercised > 20


def test_memory_error_shows_the_best_split() -> None:
    tree = chain_tree([1.0] * 4, params=[100] * 4)
    with pytest.raises(PartitionMemoryError) as err:
        partition_tree(tree, 2, memory_weight=0.5, memory_cap_bytes=500, in_flight=[2, 1])
    message = str(err.value)
    assert "Best split without the memory cap" in message and "pipeline_parallel_degree" in message
    assert "rank(s) [0, 1]" in message


def test_in_flight_shifts_activation_heavy_work_off_rank_0() -> None:
    tree = chain_tree([1.0] * 8, acts=[10] * 8)
    even = partition_tree(tree, 2, memory_weight=1.0, in_flight=[1, 1])
    assert [t.activation_bytes for t in even.rank_totals()] == [40, 40]
    capped = partition_tree(tree, 2, memory_weight=0.0, memory_cap_bytes=132, in_flight=[4, 1])
    assert capped.memory_bytes()[0] <= 132 and capped.rank_totals()[0].activation_bytes == 30


def test_every_rank_owns_parameters_when_glue_code_outweighs_the_layers() -> None:
    # A model body whose own work (measured in a hiccup of the machine) outweighs all its layers:
    # the cheapest bottleneck is that glue alone on rank 0, which would hold none of the model.
    nodes = [dataclasses.replace(n, compute=100.0) if n.path == "model" else n for n in _lm(4, tied=False)]
    for ranks, virtual in ((2, 1), (3, 1), (2, 2)):
        part = partition_tree(ModuleTree(nodes), ranks, memory_weight=0.2, virtual_stages=virtual)
        assert all(t.param_bytes > 0 for t in part.rank_totals()), (ranks, virtual, part.assignment)
        assert all(s.totals.param_bytes > 0 for s in part.segments()), "and so does every chunk"
    # With fewer parameterised pieces than ranks, a rank gets glue code only, rather than an error.
    tree = ModuleTree([ModuleNode("", ("a", "b"), compute=5.0), ModuleNode("a", param_bytes=4, compute=1.0),
                       ModuleNode("b", compute=1.0)])
    part = partition_tree(tree, 2, memory_weight=0.0)
    assert sorted(t.param_bytes for t in part.rank_totals()) == [0, 4]


def test_too_few_pieces_and_bad_arguments() -> None:
    tree = chain_tree([1.0, 1.0])
    with pytest.raises(PartitionError, match="too few indivisible pieces"):
        partition_tree(tree, 3, memory_weight=0.5)
    with pytest.raises(PartitionError, match="num_ranks"):
        partition_tree(tree, 0, memory_weight=0.5)
    with pytest.raises(PartitionError, match="memory_weight"):
        partition_tree(tree, 2, memory_weight=1.5)
    with pytest.raises(PartitionError, match="in_flight has 3 entries"):
        partition_tree(tree, 2, memory_weight=0.5, in_flight=[1, 2, 3])


def test_no_compute_falls_back_to_module_count() -> None:
    tree = ModuleTree([ModuleNode("", tuple(f"b{i}" for i in range(6))),
                       *[ModuleNode(f"b{i}", param_bytes=4) for i in range(6)]])
    part = partition_tree(tree, 3, memory_weight=0.0)
    assert [len(part.local_paths(r)) for r in range(3)] == [3, 2, 2]  # root rides with rank 0


def test_partition_round_trips_through_plain_data() -> None:
    tree = _lm(4, tied=True)
    part = partition_tree(tree, 2, memory_weight=0.2)
    again = TreePartition.from_dict(tree, part.to_dict())
    assert again.assignment == part.assignment and again.chain() == part.chain()
    with pytest.raises(PartitionError, match="malformed"):
        TreePartition.from_dict(tree, {"assignment": [], "num_ranks": 2})


def test_stage_ranks_follow_the_schedule_chain() -> None:
    """zero-bubble V: parts 0 1 1 0 over 2 ranks; the two adjacent ones on rank 1 are one segment
    (the rank runs them back to back) with twice the share of work."""
    part = partition_tree(chain_tree([1.0] * 8), 2, memory_weight=0.0, stage_ranks=(0, 1, 1, 0))
    assert part.chain() == (0, 1, 0)
    assert [len(s.items) for s in part.segments()] == [2, 4, 2]
    assert part.local_paths(1) == ("b2", "b3", "b4", "b5")
    again = TreePartition.from_dict(part.tree, part.to_dict())
    assert again.chain() == (0, 1, 0)


def test_the_bottom_of_a_v_balances_ranks_not_stages() -> None:
    """A heavy last block (an LM head): counted per stage, the two middle stages could each stay
    under the bottleneck while together they outweigh rank 0's two ends; counted as one part of
    weight 2, rank 1's middle gets exactly half the work."""
    part = partition_tree(chain_tree([1.0] * 8 + [4.0]), 2, memory_weight=0.0, stage_ranks=(0, 1, 1, 0))
    loads = [sum(1.0 if p != "b8" else 4.0 for p in part.local_paths(r) if p.startswith("b")) for r in range(2)]
    assert loads == [6.0, 6.0], (loads, part.local_paths(1))
    assert part.chain() == (0, 1, 0)
    with pytest.raises(PartitionError, match="stage_ranks"):
        partition_tree(chain_tree([1.0] * 8), 2, memory_weight=0.0, stage_ranks=(0, 2))


def test_a_v_over_two_ranks_weighs_its_ends_by_the_microbatches() -> None:
    """The V's estimated step is microbatches x the larger rank sum + the difference of its ends
    (`partition_chain`); the tree opens modules and picks the split by the same estimate."""
    costs = [1.0, 4.0, 6.0, 5.0, 3.0, 6.0, 6.0]
    few = partition_tree(chain_tree(costs), 2, memory_weight=0.0, stage_ranks=(0, 1, 1, 0), microbatches=8)
    many = partition_tree(chain_tree(costs), 2, memory_weight=0.0, stage_ranks=(0, 1, 1, 0), microbatches=64)
    assert few.local_paths(1)[-3:] == ("b3", "b4", "b5"), few.local_paths(1)  # ends 11 and 6, rank sums 17 / 14
    assert many.local_paths(1)[-3:] == ("b1", "b2", "b3"), many.local_paths(1)  # ends 1 and 15, rank sums 16 / 15
    with pytest.raises(PartitionError, match="microbatches"):
        partition_tree(chain_tree(costs), 2, memory_weight=0.0, stage_ranks=(0, 1, 1, 0), microbatches=0)


def test_virtual_stages_with_a_memory_cap_split_the_rank_budget() -> None:
    tree = chain_tree([1.0] * 8, acts=[10] * 8)
    part = partition_tree(tree, 2, memory_weight=0.0, virtual_stages=2, memory_cap_bytes=40,
                          param_memory_factor=0.0)
    assert part.chain() == (0, 1, 0, 1) and max(part.memory_bytes()) <= 40
    with pytest.raises(PartitionMemoryError, match="memory_cap_bytes=39 B"):
        partition_tree(tree, 2, memory_weight=0.0, virtual_stages=2, memory_cap_bytes=39, param_memory_factor=0.0)


def test_atomic_modules_are_never_opened() -> None:
    nodes = [ModuleNode("", ("a", "b", "c")),
             ModuleNode("a", ("a.x", "a.y"), atomic=True), ModuleNode("a.x", param_bytes=1, compute=3.0),
             ModuleNode("a.y", param_bytes=1, compute=3.0),
             ModuleNode("b", param_bytes=1, compute=1.0), ModuleNode("c", param_bytes=1, compute=1.0)]
    part = partition_tree(ModuleTree(nodes), 2, memory_weight=0.0)
    assert part.rank_of("a.x") == part.rank_of("a.y") == 0 and _rank_compute(part) == [6.0, 2.0]
    opened = [ModuleNode(n.path, n.children, n.param_bytes, compute=n.compute) for n in nodes]
    part = partition_tree(ModuleTree(opened), 2, memory_weight=0.0)
    assert _rank_compute(part) == [3.0, 5.0], "without the flag the block is opened"


def test_exclusive_compute_subtracts_the_members_of_a_never_called_container() -> None:
    """A parent looping over a ModuleList's members: the list itself has no timing, its members do;
    the parent's own cost must not include them (it did, doubling the layers' weight)."""
    from smp.partition import exclusive_compute

    own = exclusive_compute({"": 12.0, "model": 11.0, "model.embed": 1.0, "model.layers.0": 4.0,
                             "model.layers.1": 5.0},
                            {"": ["model"], "model": ["model.embed", "model.layers"],
                             "model.layers": ["model.layers.0", "model.layers.1"]})
    assert own == {"": 1.0, "model": 1.0, "model.embed": 1.0, "model.layers.0": 4.0, "model.layers.1": 5.0}


def test_the_way_back_of_a_v_is_never_cut_inside_a_marked_layer() -> None:
    """A layer marked ``no_return_cut`` may be cut on the way out (rank 0 -> 1) but not on the way
    back to rank 0: the last part starts at a layer boundary (unmarked, the exact split cuts there)."""
    def tree(marked: bool) -> ModuleTree:
        nodes = [ModuleNode("", ("layers",)), ModuleNode("layers", tuple(f"l{i}" for i in range(3)))]
        for i, (a, b) in enumerate([(1.0, 1.0), (2.0, 2.0), (1.0, 3.0)]):
            nodes.append(ModuleNode(f"l{i}", (f"l{i}.a", f"l{i}.b"), no_return_cut=marked))
            nodes += [ModuleNode(f"l{i}.a", param_bytes=1, compute=a), ModuleNode(f"l{i}.b", param_bytes=1, compute=b)]
        return ModuleTree(nodes)

    free = partition_tree(tree(False), 2, memory_weight=0.0, stage_ranks=(0, 1, 1, 0), tolerance=0.0)
    assert (free.assignment["l2.a"], free.assignment["l2.b"]) == (1, 0), free.assignment  # back inside l2
    part = partition_tree(tree(True), 2, memory_weight=0.0, stage_ranks=(0, 1, 1, 0), tolerance=0.0)
    assert part.chain() == (0, 1, 0)
    assert part.assignment["l2.a"] == part.assignment["l2.b"], part.assignment
