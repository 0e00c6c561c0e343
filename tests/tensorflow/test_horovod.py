"""smp.tensorflow.horovod: Horovod's verbs over the DP group, at dp2 (2 ranks) and pp2 x dp2 (4 ranks).

Every collective is checked against values computed from what each rank contributed (known to
every rank: they are functions of the world rank), eagerly and inside a ``tf.function``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from tests.helpers.mpi_spawn import run_mpi_ranks

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


def _value(world_rank: int) -> np.ndarray:
    return (np.arange(6, dtype=np.float32).reshape(2, 3) + 1.0) * (world_rank + 1) + 0.25 * world_rank


def hvd_rank_fn(config: dict[str, Any]) -> dict[str, Any]:
    import keras
    import smp.tensorflow as smp
    import smp.tensorflow.horovod as hvd
    import tensorflow as tf

    smp.init(config)
    hvd.init()  # accepted after smp.init, as SMP v1 scripts may still call it
    me, group = smp.rank(), smp.get_dp_group()
    out: dict[str, Any] = {"size": hvd.size(), "rank": hvd.rank(), "local_rank": hvd.local_rank(),
                           "local_size": hvd.local_size(), "group": group, "initialized": hvd.is_initialized()}
    x = tf.constant(_value(me))
    out["avg_eager"] = hvd.allreduce(x).numpy()
    out["avg_deprecated"] = hvd.allreduce(x, average=True).numpy()
    out["sum_eager"] = hvd.allreduce(x, op=hvd.Sum).numpy()
    out["scaled"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5).numpy()
    out["int_sum"] = hvd.allreduce(tf.constant([me, 1], tf.int64), op=hvd.Sum).numpy()

    @tf.function
    def in_graph(t: Any) -> Any:
        return hvd.allreduce(t), hvd.allreduce(t, op=hvd.Sum, name="sum_in_graph")

    avg, total = in_graph(x)
    out["avg_graph"], out["sum_graph"] = avg.numpy(), total.numpy()
    # an already-averaged gradient comes back unchanged (bit for bit: the replicas hold equal values)
    same = tf.constant(_value(group[0]) / 3.0)
    out["unchanged"] = bool(np.array_equal(hvd.allreduce(same).numpy(), same.numpy()))
    # IndexedSlices (an embedding's gradient) is densified
    table = tf.Variable(tf.zeros((5, 2)))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(table, [me % 5, 4]) * float(me + 1))
    sparse = tape.gradient(loss, table)
    out["sparse_type"] = type(sparse).__name__
    out["sparse_avg"] = hvd.allreduce(sparse).numpy()
    # differentiable: d/dx sum(allreduce_avg(x) * w) = allreduce_avg(w)
    w = tf.constant(_value(me) * 0.5)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(hvd.allreduce(x) * w)
    out["grad_of_allreduce"] = tape.gradient(y, x).numpy()
    # broadcast: tensors, variables (eager and in a tf.function), Python objects
    out["bcast"] = hvd.broadcast(x, root_rank=1).numpy()
    keras.utils.set_random_seed(me)  # every rank starts with different weights
    model = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(2)])
    model(np.zeros((1, 3), np.float32))
    opt = keras.optimizers.Adam(0.1)
    opt.build(model.trainable_variables)
    for v in opt.variables:
        v.assign(tf.fill(v.shape, tf.cast(me + 7, v.dtype)))
    out["model_before_bcast"] = [v.numpy() for v in model.variables]
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(opt.variables, root_rank=0)
    out["model_after_bcast"] = [v.numpy() for v in model.variables]
    out["opt_after_bcast"] = [v.numpy() for v in opt.variables]
    extra = tf.Variable(tf.fill((3,), float(me)))

    @tf.function
    def bcast_in_graph() -> Any:
        hvd.broadcast_variables([extra], root_rank=1)
        return extra.read_value()

    out["var_bcast_graph"] = bcast_in_graph().numpy()
    out["object"] = hvd.broadcast_object({"from": me}, root_rank=1)
    errors = {}
    for label, call in [("optimizer", lambda: hvd.DistributedOptimizer(opt)),
                        ("tape", lambda: hvd.DistributedGradientTape(tf.GradientTape())),
                        ("adasum", lambda: hvd.allreduce(x, op=hvd.Adasum)),
                        ("both", lambda: hvd.allreduce(x, average=True, op=hvd.Sum)),
                        ("root", lambda: hvd.broadcast(x, root_rank=hvd.size())),
                        ("init_comm", lambda: hvd.init(comm=[0, 1]))]:
        try:
            call()
            errors[label] = "no error"
        except Exception as e:  # noqa: BLE001 - the test compares the messages
            errors[label] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    return out


def _check(got: list[dict[str, Any]], dp_groups: list[list[int]]) -> None:
    for r, out in enumerate(got):
        group = next(g for g in dp_groups if r in g)
        assert out["group"] == group
        assert (out["size"], out["rank"], out["initialized"]) == (len(group), group.index(r), True)
        assert (out["local_rank"], out["local_size"]) == (group.index(r), len(group))  # one host
        total = np.sum([_value(m) for m in group], axis=0)
        mean = total / len(group)
        for key in ("avg_eager", "avg_deprecated", "avg_graph"):
            np.testing.assert_allclose(out[key], mean, rtol=1e-6, err_msg=f"rank {r} {key}")
        for key in ("sum_eager", "sum_graph", "scaled"):
            np.testing.assert_allclose(out[key], total, rtol=1e-6, err_msg=f"rank {r} {key}")
        np.testing.assert_array_equal(out["int_sum"], [sum(group), len(group)])
        assert out["unchanged"]
        assert out["sparse_type"] == "IndexedSlices"
        dense = np.zeros((5, 2), np.float32)
        for m in group:
            dense[m % 5] += m + 1
            dense[4] += m + 1
        np.testing.assert_allclose(out["sparse_avg"], dense / len(group), rtol=1e-6)
        np.testing.assert_allclose(out["grad_of_allreduce"], np.mean([_value(m) * 0.5 for m in group], axis=0),
                                   rtol=1e-6)
        np.testing.assert_array_equal(out["bcast"], _value(group[1]))
        root = got[group[0]]
        for a, b in zip(out["model_after_bcast"] + out["opt_after_bcast"],
                        root["model_after_bcast"] + root["opt_after_bcast"]):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(out["var_bcast_graph"], np.full(3, float(group[1])))
        assert out["object"] == {"from": group[1]}
        errors = out["errors"]
        assert errors["optimizer"].startswith("HorovodAPIError") and "Avoid hvd.DistributedOptimizer" in errors["optimizer"]
        assert errors["tape"].startswith("HorovodAPIError") and "plain tf.GradientTape" in errors["tape"]
        assert errors["adasum"].startswith("HorovodAPIError") and "op=hvd.Average" in errors["adasum"]
        assert errors["both"].startswith("ValueError") and "give one of them" in errors["both"]
        assert errors["root"].startswith("ValueError") and f"0..{len(group) - 1}" in errors["root"]
        assert errors["init_comm"].startswith("HorovodAPIError")
        if r != group[0]:  # the weights differed before the broadcast: it really replaced them
            assert not np.array_equal(out["model_before_bcast"][0], root["model_before_bcast"][0])


@pytest.mark.mpi
def test_dp2() -> None:
    got = run_mpi_ranks(hvd_rank_fn, 2, args=({"partitions": 1, "horovod": True},), timeout=180)
    _check(got, [[0, 1]])


@pytest.mark.mpi
def test_pp2_dp2_uses_the_dp_group_only() -> None:
    got = run_mpi_ranks(hvd_rank_fn, 4, args=({"partitions": 2, "horovod": True},), timeout=240)
    from smp.topology import GroupKind, RankMap

    groups = RankMap.from_world(4, pp_size=2, tp_size=1).groups(GroupKind.DP)
    assert all(len(g) == 2 for g in groups)
    _check(got, groups)


def test_before_init_and_replaced_classes() -> None:
    import smp.tensorflow.horovod as hvd

    from smp.errors import NotInitializedError

    assert hvd.REAL_HOROVOD is False  # Horovod 0.28.1 does not build against TF 2.21 (dev environment)
    assert not hvd.is_initialized()
    for fn in (hvd.init, hvd.size, hvd.rank, hvd.local_rank, hvd.local_size):
        with pytest.raises(NotInitializedError, match="smp.init"):
            fn()
    with pytest.raises(hvd.HorovodAPIError, match="Avoid hvd.DistributedOptimizer"):
        hvd.DistributedOptimizer(object())
    with pytest.raises(NotImplementedError, match="plain tf.GradientTape"):
        hvd.DistributedGradientTape(object())
