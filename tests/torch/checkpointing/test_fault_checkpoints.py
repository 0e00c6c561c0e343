"""Checkpoints under faults, on real ranks: a rank killed mid-save, damaged files, and full state
under tensor parallelism.

Killed saves (a new tag, and the tag that already exists) fail in seconds and leave the last
committed checkpoint resuming with the losses of the uninterrupted run. Damaged files (a
truncated model file, random bytes in an optimizer file, an empty smp_config.pt, a truncated
``smp.load`` file) fail on every rank in seconds with the file and the rank named, never a raw gloo
error. Every full-state path (``state_dict``, ``cpu()``, ``smp.save(partial=False)``,
``save_checkpoint(partial=False)``, ``save_pretrained``) gives the dense model's tensors at
tp2 x pp1, tp2 x pp2, tp2 x rdp2 and tp1 x pp2.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.spawn import run_ranks
from tests.torch import zoo

TIMEOUT = 90.0  # comm_timeout: every failure below must come far sooner
FAST = 30.0  # seconds; generous for a loaded 2-core machine, a third of the timeout
CFG = {"pipeline_parallel_degree": 2, "microbatches": 4, "auto_partition": False, "default_partition": 0,
       "comm_timeout": TIMEOUT}


def _setup(resume: tuple[str, str | None] | None = None) -> tuple[Any, Any, Any, Any, Any]:
    import smp.torch as smp

    smp.init(CFG)
    content = smp.resume_from_checkpoint(resume[0], tag=resume[1]) if resume else None
    net = zoo.build("gpt")
    model = smp.DistributedModel(net)
    net.place(2, smp.set_partition)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return smp, model, opt, zoo.train_step("gpt"), content


def _train(steps: range, model: Any, opt: Any, train_step: Any) -> list[float]:
    data = zoo.batches("gpt", 6)
    return zoo.train_losses(model, opt, train_step, [data[i] for i in steps])


def _kill_while_writing(name: str) -> None:
    """On this rank, SIGKILL the process halfway through writing the checkpoint file ``name``."""
    from smp.torch.checkpointing import files

    real = files.atomic_save

    def dying_save(obj: Any, path: Any, **kwargs: Any) -> Any:
        if os.path.basename(str(path)) != name:
            return real(obj, path, **kwargs)

        def half_then_die(f: Any) -> None:
            buf = io.BytesIO()
            torch.save(obj, buf)
            f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        return files.atomic_write(path, half_then_die)

    files.atomic_save = dying_save  # type: ignore[assignment]


def _train_save_and_kill(path: str, kill_tag: str, kill_file: str) -> tuple[list[float], float, str]:
    """Train 6 steps with committed checkpoints step3 and step5 (and an smp.save file), then save
    ``kill_tag`` while rank 1 dies writing ``kill_file``. Rank 0 returns the losses, how long the
    failed save took and its error."""
    smp, model, opt, step, _ = _setup()
    losses = _train(range(3), model, opt, step)
    smp.save_checkpoint(path, "step3", model=model, optimizer=opt, user_content={"step": 3})
    losses += _train(range(3, 5), model, opt, step)
    smp.save_checkpoint(path, "step5", model=model, optimizer=opt, user_content={"step": 5})
    smp.save({"rank": smp.rank(), "w": torch.arange(1000.0)}, os.path.join(path, "extra"), partial=True)
    losses += _train(range(5, 6), model, opt, step)
    if smp.rank() == 1:
        _kill_while_writing(kill_file)
    start = time.monotonic()
    try:
        smp.save_checkpoint(path, kill_tag, model=model, optimizer=opt, user_content={"step": 6})
        result = (losses, time.monotonic() - start, "no error")
    except Exception as e:  # noqa: BLE001 - the test inspects it
        result = (losses, time.monotonic() - start, f"{type(e).__name__}: {e}\n{getattr(e, '__notes__', '')}")
    # Also through a file: run_ranks stops reading results a few seconds after a rank died, which
    # can come before the survivor notices (the dead-peer detection takes seconds by design).
    with open(path + ".rank0", "wb") as f:
        pickle.dump(result, f)
    return result


def _resume_and_train(path: str, tag: str | None, first: int) -> tuple[Any, list[float]]:
    _, model, opt, step, content = _setup((path, tag))
    return content, _train(range(first, 6), model, opt, step)


def _kill_run(path: str, kill_tag: str, kill_file: str) -> tuple[list[float], float, str]:
    got = run_ranks(_train_save_and_kill, 2, args=(path, kill_tag, kill_file), timeout=180, expect_failure=True)
    assert got[1] == ("died", -signal.SIGKILL), got  # rank 1 was killed mid-write
    assert got[0][0] == "ok" or got[0] == ("died", 0), got  # rank 0 returned (maybe after run_ranks stopped reading)
    with open(path + ".rank0", "rb") as f:
        losses, elapsed, error = pickle.load(f)
    assert error != "no error"
    assert elapsed < FAST, f"the save failed after {elapsed:.1f} s (comm_timeout {TIMEOUT:g} s): {error}"
    assert "rank 1" in error, error  # the dead rank is named
    assert "a save that fails never modifies a committed checkpoint" in error and "['step3', 'step5']" in error
    return losses, elapsed, error


def _newest(path: str) -> list[str]:
    return Path(path, "newest").read_text().split()


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[float]]:
    """A checkpoint directory whose save of the new tag step6 was killed on rank 1, and the losses
    of the uninterrupted run up to it (steps 0-5)."""
    path = str(tmp_path_factory.mktemp("killed") / "ckpt")
    losses, _, _ = _kill_run(path, "step6", "model_1_0.pt")
    return path, losses


@pytest.mark.slow
def test_a_rank_killed_while_saving_the_tag_that_exists(tmp_path: Path) -> None:
    """The issue's case: the re-save of step5 dies after rank 1 wrote its new model file, while its
    optimizer file is half written. step5 stays listed and resumes as it was first saved."""
    path = str(tmp_path / "ckpt")
    losses, _, _ = _kill_run(path, "step5", "optimizer_1_0.pt")
    assert _newest(path) == ["step3", "step5"]
    for content, resumed in run_ranks(_resume_and_train, 2, args=(path, "step5", 5), timeout=180):
        assert content == {"step": 5}
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[5:]), rtol=1e-6, atol=1e-7)


def _damage(file: Path, how: str) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if how == "truncated" else os.urandom(len(data)) if how == "random"
                     else b"")


DAMAGES = [("model_1_0.pt", "truncated", 1), ("optimizer_0_0.pt", "random", 0), ("smp_config.pt", "empty", None)]


def _resume_damaged_then_intact(damaged: list[str], intact: str) -> tuple[list[tuple[str, float]], Any, list[float]]:
    """Resume each damaged checkpoint (each fails on every rank), then, in the same process, the
    intact one: the errors leave the ranks in step and nothing half-applied."""
    import smp.torch as smp

    smp.init(CFG)
    errors = []
    for path in damaged:
        start = time.monotonic()
        try:
            smp.resume_from_checkpoint(path)
            error = "no error"
        except Exception as e:  # noqa: BLE001 - the test inspects it
            error = f"{type(e).__name__}: {e}"
        errors.append((error, time.monotonic() - start))
    _, model, opt, step, content = _setup((intact, None))
    return errors, content, _train(range(5, 6), model, opt, step)


def test_a_killed_save_and_damaged_files(killed: tuple[str, list[float]], tmp_path: Path) -> None:
    """The save of a new tag killed on rank 1 left step5 the newest checkpoint, and it resumes with
    the uninterrupted run's losses; copies of it with one damaged file each fail on every rank,
    in seconds, with the file (and on the peers the rank that could not read it) named."""
    path, losses = killed
    assert _newest(path) == ["step3", "step5"]
    damaged = []
    for name, how, _ in DAMAGES:
        copy = tmp_path / name
        shutil.copytree(path, copy)
        _damage(copy / "step5_partial" / name, how)
        damaged.append(str(copy))
    for r, (errors, content, resumed) in enumerate(run_ranks(_resume_damaged_then_intact, 2, args=(damaged, path),
                                                             timeout=180)):
        for (name, how, bad_rank), copy, (error, elapsed) in zip(DAMAGES, damaged, errors):
            assert elapsed < FAST, (r, elapsed, error)
            assert error.startswith("SMPCheckpointError"), (r, error)
            assert str(Path(copy, "step5_partial", name)) in error, (r, error)
            assert ("damaged" if how == "random" else "truncated") in error, error
            assert "gloo" not in error.lower(), error
            if bad_rank is not None and r != bad_rank:  # a peer says which rank could not read the file
                assert f"failed on rank(s) [{bad_rank}]" in error, error
            assert "Fix: resume another checkpoint" in error and "['step3']" in error, error  # the intact one
        assert content == {"step": 5}
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[5:]), rtol=1e-6, atol=1e-7)


def _load_damaged(path: str) -> tuple[str, float]:
    import smp.torch as smp

    smp.init(CFG)
    start = time.monotonic()
    try:
        got = smp.load(os.path.join(path, "extra"))
        assert got["rank"] == smp.rank()
        smp.barrier()  # rank 0 waits here for rank 1, which could not read its file
    except Exception as e:  # noqa: BLE001 - the test inspects it
        if smp.rank() == 1:
            raise  # uncaught, as in a script: the failure protocol tells the peers
        return f"{type(e).__name__}: {e}", time.monotonic() - start
    return "no error", time.monotonic() - start


def test_smp_load_of_a_truncated_partial_file_names_it_on_every_rank(killed: tuple[str, list[float]],
                                                                    tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    shutil.copytree(killed[0], path)
    bad = Path(path, "extra_1_0.pt")
    _damage(bad, "truncated")
    got = run_ranks(_load_damaged, 2, args=(path,), timeout=120, expect_failure=True)
    assert got[1][0] == "error" and "SMPCheckpointError" in got[1][1] and str(bad) in got[1][1], got
    assert "Fix: save it again" in got[1][1]
    assert got[0][0] == "ok", got
    error, elapsed = got[0][1]
    assert elapsed < FAST, (elapsed, error)
    assert error.startswith("RemoteRankError") and re.search(r"rank 1 \(pp_rank .*; pid \d+ on host .+\) failed", error) and str(bad) in error, error


# ----------------------------------------------------------------------------------------------
# Item 1: full tensors from every full-state path, at every layout


def _dense_after_one_step() -> dict[str, torch.Tensor]:
    """The Llama of test_tp_distributed_model in one process, after one SGD step on the global batch."""
    from tests.torch.tp.test_tp_distributed_model import _data
    from tests.torch.tp.test_tp_hf import _model

    ref = _model("llama")
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    ids = _data()
    ref(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return {k: v.detach().clone() for k, v in ref.state_dict().items()}


def _full_states(pp: int, tp: int, rdp: int, path: str) -> dict[str, Any]:
    import smp.torch as smp
    from smp.torch.nn import full_state_dict

    from tests.torch.tp.test_tp_distributed_model import _data
    from tests.torch.tp.test_tp_hf import _model

    smp.init({"tensor_parallel_degree": tp, "pipeline_parallel_degree": pp, "ddp": True, "microbatches": 2,
              "auto_partition": False, "default_partition": 0, "comm_timeout": TIMEOUT})
    hf = _model("llama")
    if tp > 1:
        smp.transform(hf)
    model = smp.DistributedModel(hf)
    if pp > 1:
        for layer in hf.model.layers[1:]:
            smp.set_partition(layer, 1)
        smp.set_partition(hf.lm_head, 1)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    ids = _data().chunk(smp.dp_size())[smp.dp_rank()]  # SMP v1's per-rank batches
    opt.zero_grad()
    zoo.hf_train_step()(model, ids, ids)
    opt.step()

    out: dict[str, Any] = {"rdp_rank": smp.rdp_rank()}
    first_replica = smp.rdp_rank() == 0
    state = model.state_dict() if first_replica else {}
    out["state_dict"] = state
    smp.save(state, os.path.join(path, "smp_save.pt"), partial=False)
    smp.save_checkpoint(path, "full", partial=False, model=model)
    model.save_pretrained(os.path.join(path, "hf"))
    model.cpu()
    out["state_dict after cpu()"] = model.state_dict() if first_replica else {}
    # cpu() put the other stage's tensors into this process's module: this tp_rank's shards of them
    out["module after cpu()"] = full_state_dict(model.module, smp.get_tp_process_group() if tp > 1 else None)
    return out


def _check_full(got: dict[str, torch.Tensor], dense: dict[str, torch.Tensor], what: str) -> None:
    got = {k: v for k, v in got.items() if not k.startswith("_smp")}
    assert sorted(got) == sorted(dense), (what, sorted(set(got) ^ set(dense)))
    for k, v in dense.items():
        assert tuple(got[k].shape) == tuple(v.shape), f"{what}: {k} has shape {tuple(got[k].shape)}, dense {tuple(v.shape)}"
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{what}: {k}: {m}")


@pytest.fixture(scope="module")
def dense() -> dict[str, torch.Tensor]:
    return _dense_after_one_step()


@pytest.mark.slow
@pytest.mark.parametrize(("pp", "tp", "rdp"), [(1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 1, 1)],
                         ids=["tp2", "tp2-pp2", "tp2-rdp2", "pp2"])
def test_every_full_state_path_gives_the_dense_tensors(dense: dict[str, torch.Tensor], tmp_path: Path, pp: int,
                                                       tp: int, rdp: int) -> None:
    transformers = pytest.importorskip("transformers")
    results = run_ranks(_full_states, pp * tp * rdp, args=(pp, tp, rdp, str(tmp_path)), timeout=300)
    params = {k for k, _ in transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).named_parameters()}
    _check_full(results[0]["state_dict"], dense, "state_dict()")
    _check_full(results[0]["state_dict after cpu()"], dense, "state_dict() after cpu()")
    _check_full(torch.load(tmp_path / "smp_save.pt"), dense, "smp.save(partial=False)")
    _check_full(torch.load(tmp_path / "full", weights_only=False), dense, "save_checkpoint(partial=False)")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).state_dict()
    _check_full({k: v for k, v in hf.items() if k in params}, {k: v for k, v in dense.items() if k in params},
                "save_pretrained")
    for r, res in enumerate(results):
        dense_params = {k: v for k, v in dense.items() if k in res["module after cpu()"]}
        assert len(dense_params) == len(params)
        _check_full(res["module after cpu()"], dense_params, f"rank {r}'s module after cpu()")
        if pp == 1 and res["rdp_rank"] == 0:  # every rank of the first replica gets it at pp 1
            _check_full(res["state_dict"], dense, f"rank {r}'s state_dict()")
