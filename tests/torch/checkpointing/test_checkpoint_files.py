"""The checkpoint file layer on real files: atomic writes under crashes (exceptions and killed
processes), SMP v1 partial names, the save_checkpoint layout, ``newest`` and pruning, staged saves
that never touch a committed checkpoint, manifests, and load errors that name the damaged file."""

from __future__ import annotations

import logging
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from smp.torch.checkpointing import files as ckpt
from smp.torch.checkpointing.files import (
    atomic_save,
    commit_partial_checkpoint,
    detect_rankinfo,
    prepare_partial_checkpoint,
    read_full_checkpoint,
    read_newest,
    read_partial_checkpoint,
    write_full_checkpoint,
    write_partial_checkpoint,
)

import smp
from smp.checkpoint import MANIFEST, TEMP_SUFFIX, atomic_write_text, layout
from smp.checkpoint.layout import partial_dir
from smp.checkpoint.names import find_partial, partial_candidates, partial_name, rank_info
from smp.errors import SMPCheckpointError

ROOT = Path(__file__).resolve().parents[3]


def temp_files(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(TEMP_SUFFIX))


# ----------------------------------------------------------------------------------------------
# Atomic writes


def test_atomic_save_round_trip_and_overwrite(tmp_path: Path) -> None:
    p = tmp_path / "model.pt"
    atomic_save({"w": torch.arange(4.0)}, p)
    atomic_save({"w": torch.ones(3)}, str(p))
    torch.testing.assert_close(torch.load(p)["w"], torch.ones(3))
    assert temp_files(tmp_path) == []


def test_atomic_save_respects_umask(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        atomic_save(1, tmp_path / "a.pt")
        atomic_write_text("x", tmp_path / "b")
    finally:
        os.umask(umask)
    for name in ("a.pt", "b"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o644


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_failed_save_leaves_previous_file_loadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   error: BaseException) -> None:
    p = tmp_path / "model.pt"
    atomic_save({"step": 1, "w": torch.full((1000,), 1.0)}, p)
    real_save = torch.save

    def half_then_fail(obj: Any, f: Any, **kwargs: Any) -> None:
        import io

        buf = io.BytesIO()
        real_save(obj, buf, **kwargs)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])  # half a checkpoint reaches the disk
        f.flush()
        raise error

    monkeypatch.setattr(torch, "save", half_then_fail)
    with pytest.raises(type(error)):
        atomic_save({"step": 2, "w": torch.full((1000,), 2.0)}, p)
    monkeypatch.undo()
    loaded = torch.load(p)
    assert loaded["step"] == 1 and torch.equal(loaded["w"], torch.full((1000,), 1.0))
    assert temp_files(tmp_path) == []


def test_failed_text_write_leaves_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "newest"
    atomic_write_text("step_1\n", p)

    def fail(fd: int) -> None:
        raise OSError("I/O error")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="I/O error"):
        atomic_write_text("step_1\nstep_2\n", p)
    monkeypatch.undo()
    assert p.read_text() == "step_1\n" and temp_files(tmp_path) == []


KILL_MID_WRITE = textwrap.dedent("""
    import io, os, sys, time
    import torch
    from smp.torch.checkpointing import files as ckpt

    path, n_saves = sys.argv[1], int(sys.argv[2])
    real_save = torch.save

    def stalling_save(obj, f, **kwargs):
        # Write half of the file for real, tell the parent, and wait to be killed.
        buf = io.BytesIO()
        real_save(obj, buf, **kwargs)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        f.flush()
        os.fsync(f.fileno())
        print("MIDWAY", flush=True)
        time.sleep(60)

    def run(i):
        ckpt.atomic_save({"i": i, "t": torch.full((1_000_000,), float(i))}, path)

    for i in range(n_saves):
        run(i)
    torch.save = stalling_save
    run(n_saves)
""")


def run_until_midway(script: str, *args: str) -> None:
    """Run ``script`` in a fresh interpreter, SIGKILL it once it prints MIDWAY (it is then stalled in
    the middle of writing a file), and check it really was killed there."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line.strip())
            if line.strip() == "MIDWAY":
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, (lines, proc.stderr.read() if proc.stderr else "")


def test_process_killed_mid_write_leaves_previous_file(tmp_path: Path) -> None:
    p = tmp_path / "model.pt"
    run_until_midway(KILL_MID_WRITE, str(p), "3")
    leftovers = temp_files(tmp_path)
    assert len(leftovers) == 1  # the half-written temp file of the killed save...
    assert os.path.getsize(tmp_path / leftovers[0]) > 0
    loaded = torch.load(p)  # ...while the file itself is the last complete save
    assert loaded["i"] == 2 and torch.equal(loaded["t"], torch.full((1_000_000,), 2.0))


# ----------------------------------------------------------------------------------------------
# smp.save / smp.load names


def test_partial_names() -> None:
    assert partial_name("ck/model", 0, 1) == "ck/model_0_1.pt"
    assert partial_name("ck/model", 2, 3, 1) == "ck/model_2_3_1.pt"
    assert rank_info(2, 3) == "2_3" and rank_info(2, 3, 1) == "2_3_1"


@pytest.mark.parametrize(("saved", "rdp_rank"), [
    ("m_1_0_2.pt", 2),  # v3
    ("m_1_0.pt", 2),    # 2-part found from a rank that also has an rdp_rank
    ("m_1_0.pt", None),
    ("m_1", None),      # pre-1.6: f"{f}_{mp_rank}", mp_rank == pp_rank without TP
])
def test_find_partial_detects_the_naming_on_disk(tmp_path: Path, saved: str, rdp_rank: int | None) -> None:
    f = str(tmp_path / "m")
    atomic_save({"saved": saved}, tmp_path / saved)
    found = find_partial(f, 1, 0, rdp_rank)
    assert found == str(tmp_path / saved) and torch.load(found)["saved"] == saved


def test_find_partial_prefers_the_most_specific_name(tmp_path: Path) -> None:
    f = str(tmp_path / "m")
    for name in ("m_0_0_1.pt", "m_0_0.pt", "m_0"):
        atomic_save(name, tmp_path / name)
    assert find_partial(f, 0, 0, 1).endswith("m_0_0_1.pt")
    assert find_partial(f, 0, 0, 0).endswith("m_0_0.pt")
    assert find_partial(f, 0, 0).endswith("m_0_0.pt")


def test_one_part_name_needs_tp_rank_0_or_an_explicit_mp_rank(tmp_path: Path) -> None:
    f = str(tmp_path / "m")
    atomic_save("mp3", tmp_path / "m_3")
    with pytest.raises(SMPCheckpointError):
        find_partial(f, 1, 1)
    assert find_partial(f, 1, 1, mp_rank=3).endswith("m_3")


def test_save_load_round_trip_for_every_rank(tmp_path: Path) -> None:
    f = str(tmp_path / "model")
    for pp in range(2):
        for tp in range(2):
            for rdp in (None, 0, 1):
                atomic_save({"r": (pp, tp, rdp)}, partial_name(f, pp, tp, rdp))
    for pp in range(2):
        for tp in range(2):
            assert torch.load(find_partial(f, pp, tp))["r"] == (pp, tp, None)
            for rdp in (0, 1):
                assert torch.load(find_partial(f, pp, tp, rdp))["r"] == (pp, tp, rdp)


def test_back_compat_reads_pre_1_10_names(tmp_path: Path) -> None:
    f = str(tmp_path / "model.pt")
    atomic_save("old", tmp_path / "model.pt_1_0")
    with pytest.raises(SMPCheckpointError, match="back_compat=True"):
        find_partial(f, 1, 0)
    assert find_partial(f, 1, 0, back_compat=True).endswith("model.pt_1_0")
    assert partial_candidates("m.pt", 0, 1, 2, back_compat=True) == ["m.pt_0_1_2", "m.pt_0_1", "m.pt_0_1_2.pt",
                                                                      "m.pt_0_1.pt"]


def test_missing_partial_names_every_file_looked_for(tmp_path: Path) -> None:
    f = str(tmp_path / "m")
    with pytest.raises(SMPCheckpointError) as e:
        find_partial(f, 1, 0, 2)
    for name in (f"{f}_1_0_2.pt", f"{f}_1_0.pt", f"{f}_1"):
        assert repr(name) in str(e.value)
    assert "pp_rank=1, tp_rank=0, rdp_rank=2" in str(e.value)


# ----------------------------------------------------------------------------------------------
# save_checkpoint layout


CONFIG = {"pipeline_parallel_degree": 2, "microbatches": 4}


def model_state(tag: str, r: str) -> dict[str, Any]:
    return {"w": torch.full((3,), float(len(tag) + int(r[0]))), "tag": tag, "rank": r}


def save(path: Path, tag: str, keep: int | None = None, rankinfos: tuple[str, ...] = ("0_0", "1_0"),
         step: int | None = None) -> list[str]:
    """One partial save as the ranks of a pp=2 job do it, in the documented three phases."""
    sid = prepare_partial_checkpoint(path, tag)
    records: dict[str, Any] = {}
    for i, r in enumerate(rankinfos):
        records.update(write_partial_checkpoint(
            path, tag, r, {**model_state(tag, r), "step": step}, {"state": {}, "tag": tag, "rank": r, "step": step},
            {"tag": tag, "step": step}, CONFIG, write_shared=(i == 0), save_id=sid))
    return commit_partial_checkpoint(path, tag, sid, records, keep, expected_rankinfos=list(rankinfos))


def test_layout_of_a_partial_save(tmp_path: Path) -> None:
    assert save(tmp_path, "step_1") == ["step_1"]
    assert sorted(os.listdir(tmp_path)) == ["newest", "step_1_partial"]
    assert sorted(os.listdir(tmp_path / "step_1_partial")) == [
        "model_0_0.pt", "model_1_0.pt", "optimizer_0_0.pt", "optimizer_1_0.pt", "smp_config.pt", "smp_manifest.json",
        "user_content.pt"]
    assert (tmp_path / "newest").read_text() == "step_1\n"
    cfg = torch.load(tmp_path / "step_1_partial" / "smp_config.pt")
    assert cfg == {**CONFIG, "smp_version": smp.__version__}
    assert torch.load(tmp_path / "step_1_partial" / "user_content.pt") == {"tag": "step_1", "step": None}


def test_read_partial_checkpoint(tmp_path: Path) -> None:
    save(tmp_path, "step_1")
    got = read_partial_checkpoint(tmp_path, "step_1", "1_0")
    assert got["tag"] == "step_1" and got["model"]["rank"] == "1_0"
    torch.testing.assert_close(got["model"]["w"], model_state("step_1", "1_0")["w"])
    assert got["optimizer"] == {"state": {}, "tag": "step_1", "rank": "1_0", "step": None}
    assert got["user_content"] == {"tag": "step_1", "step": None} and got["config"]["smp_version"] == smp.__version__
    assert re.fullmatch(r"[0-9a-f]{16}", got["save_id"])
    assert got["fp16_states"] is None
    assert read_partial_checkpoint(tmp_path, "step_1", "0_0", load_optimizer=False)["optimizer"] is None


def test_newest_lists_tags_oldest_first_and_resume_picks_the_last(tmp_path: Path) -> None:
    for tag in ("step_1", "step_2", "step_10"):
        save(tmp_path, tag)
    assert read_newest(tmp_path) == ["step_1", "step_2", "step_10"]
    assert (tmp_path / "newest").read_text() == "step_1\nstep_2\nstep_10\n"
    got = read_partial_checkpoint(tmp_path, None, "0_0")
    assert got["tag"] == "step_10" and got["model"]["tag"] == "step_10"


def test_saving_a_tag_again_moves_it_last(tmp_path: Path) -> None:
    for tag in ("a", "b", "a"):
        save(tmp_path, tag)
    assert read_newest(tmp_path) == ["b", "a"]


def test_a_save_of_an_existing_tag_touches_nothing_before_its_commit(tmp_path: Path) -> None:
    save(tmp_path, "a", step=1)
    save(tmp_path, "b", step=1)
    before = {n: (tmp_path / "b_partial" / n).read_bytes() for n in os.listdir(tmp_path / "b_partial")}
    sid = prepare_partial_checkpoint(tmp_path, "b")
    write_partial_checkpoint(tmp_path, "b", "0_0", {"step": 2}, {"step": 2}, {"step": 2}, CONFIG, write_shared=True,
                             save_id=sid)
    # staged, not committed: b stays listed, last, and byte for byte what its first save wrote
    assert read_newest(tmp_path) == ["a", "b"]
    assert {n: (tmp_path / "b_partial" / n).read_bytes() for n in os.listdir(tmp_path / "b_partial")} == before
    assert read_partial_checkpoint(tmp_path, None, "0_0")["model"]["step"] == 1


@pytest.mark.parametrize(("keep", "listed"), [
    (None, ["s1", "s2", "s3", "s4"]), (0, ["s1", "s2", "s3", "s4"]), (1, ["s4"]), (2, ["s3", "s4"]),
    (4, ["s1", "s2", "s3", "s4"]),
])
def test_num_kept_partial_checkpoints(tmp_path: Path, keep: int | None, listed: list[str]) -> None:
    for tag in ("s1", "s2", "s3", "s4"):
        assert save(tmp_path, tag, keep)[-1] == tag
    assert read_newest(tmp_path) == listed
    dirs = sorted(n[: -len("_partial")] for n in os.listdir(tmp_path) if n.endswith("_partial"))
    assert dirs == listed
    for tag in listed:
        assert read_partial_checkpoint(tmp_path, tag, "1_0")["model"]["tag"] == tag


def test_failed_pruning_is_logged_and_the_save_stands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    save(tmp_path, "s1")

    def refuse(path: str, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(layout.shutil, "rmtree", refuse)
    with caplog.at_level(logging.WARNING, logger="smp.checkpoint"):
        assert save(tmp_path, "s2", keep=1) == ["s2"]
    assert "could not delete old partial checkpoint" in caplog.text and "s1_partial" in caplog.text
    assert read_newest(tmp_path) == ["s2"]


def test_crash_while_saving_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save(tmp_path, "step_1", keep=1)
    real = ckpt.atomic_save

    def crash_on_second_optimizer(obj: Any, path: Any, **kwargs: Any) -> None:
        if str(path).endswith("optimizer_1_0.pt"):
            raise OSError("No space left on device")
        real(obj, path, **kwargs)

    monkeypatch.setattr(ckpt, "atomic_save", crash_on_second_optimizer)
    with pytest.raises(OSError, match="No space left"):
        save(tmp_path, "step_2", keep=1)
    monkeypatch.undo()
    # the commit never ran: newest names step_1, and step_1 is whole and not pruned
    assert read_newest(tmp_path) == ["step_1"]
    for r in ("0_0", "1_0"):
        got = read_partial_checkpoint(tmp_path, None, r)
        assert got["tag"] == "step_1" and got["model"]["tag"] == "step_1" and got["optimizer"]["tag"] == "step_1"
    # the retry succeeds and only then prunes step_1
    assert save(tmp_path, "step_2", keep=1) == ["step_2"]
    assert not (tmp_path / "step_1_partial").exists()


def test_commit_refuses_an_incomplete_checkpoint(tmp_path: Path) -> None:
    save(tmp_path, "step_1")
    sid = prepare_partial_checkpoint(tmp_path, "step_2")
    rec = write_partial_checkpoint(tmp_path, "step_2", "0_0", {}, {}, None, CONFIG, write_shared=True, save_id=sid)
    with pytest.raises(SMPCheckpointError) as e:
        commit_partial_checkpoint(tmp_path, "step_2", sid, rec, expected_rankinfos=["0_0", "1_0"])
    assert "model_1_0.pt" in str(e.value) and "nothing was committed" in str(e.value)
    sid = prepare_partial_checkpoint(tmp_path, "step_3")
    rec = write_partial_checkpoint(tmp_path, "step_3", "0_0", {}, {}, None, CONFIG, write_shared=False, save_id=sid)
    with pytest.raises(SMPCheckpointError, match="smp_config.pt"):
        commit_partial_checkpoint(tmp_path, "step_3", sid, rec)
    assert read_newest(tmp_path) == ["step_1"]
    assert not (tmp_path / "step_2_partial").exists() and not (tmp_path / "step_3_partial").exists()


KILL_DURING_SAVE = textwrap.dedent("""
    import os, sys, time
    import torch
    from smp.checkpoint import layout
    from smp.torch.checkpointing import files as ckpt

    path, stall_on, resave = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    real_save, real_write_text, real_replace = ckpt.atomic_save, layout.atomic_write_text, os.replace
    step = 0

    def stall(where):
        if step == 3 and where.endswith(stall_on):
            print("MIDWAY", flush=True)
            time.sleep(60)

    def stalling_save(obj, f, **kwargs):
        stall(str(f))
        return real_save(obj, f, **kwargs)

    def stalling_write_text(text, f):
        stall(str(f))
        return real_write_text(text, f)

    def stalling_replace(src, dst):
        real_replace(src, dst)
        if str(src).endswith("_partial") and ".smp-old" in str(dst):
            stall("between renames")  # the previous save moved aside, the new one not yet in place

    ckpt.atomic_save, layout.atomic_write_text, os.replace = stalling_save, stalling_write_text, stalling_replace
    for step in range(1, 10):
        tag = "latest" if resave else f"step_{step}"
        sid = ckpt.prepare_partial_checkpoint(path, tag)
        records = {}
        for i, r in enumerate(["0_0", "1_0"]):
            records.update(ckpt.write_partial_checkpoint(path, tag, r, {"w": torch.full((1000,), float(step))},
                                                         {"step": step}, {"step": step}, {"microbatches": 2}, i == 0,
                                                         save_id=sid))
        ckpt.commit_partial_checkpoint(path, tag, sid, records, keep=2, expected_rankinfos=["0_0", "1_0"])
""")


def whole_save(path: Path, tag: str | None) -> int:
    """The step of the save ``tag`` holds, after checking every file of both ranks comes from it."""
    steps = set()
    for r in ("0_0", "1_0"):
        got = read_partial_checkpoint(path, tag, r)
        steps |= {int(got["model"]["w"][0].item()), got["optimizer"]["step"], got["user_content"]["step"]}
    assert len(steps) == 1, steps
    return steps.pop()


@pytest.mark.parametrize("stall_on", ["model_1_0.pt", "newest"])
def test_process_killed_during_save_resumes_from_the_previous_tag(tmp_path: Path, stall_on: str) -> None:
    run_until_midway(KILL_DURING_SAVE, str(tmp_path), stall_on, "0")
    # killed while saving step_3 ("newest": while committing it): newest names step_2, both kept tags load
    assert read_newest(tmp_path) == ["step_1", "step_2"]
    assert whole_save(tmp_path, None) == 2 and whole_save(tmp_path, "step_1") == 1


@pytest.mark.parametrize(("stall_on", "expect"), [("model_1_0.pt", 2), ("between renames", 2), ("newest", 3)])
def test_process_killed_while_saving_an_existing_tag_keeps_it_whole(tmp_path: Path, stall_on: str,
                                                                    expect: int) -> None:
    """The same tag saved every step: a kill at any point leaves ``latest`` listed and whole (the
    previous save, or, once the new one is swapped in before ``newest`` is rewritten, the new one)."""
    run_until_midway(KILL_DURING_SAVE, str(tmp_path), stall_on, "1")
    assert read_newest(tmp_path) == ["latest"]
    assert whole_save(tmp_path, None) == expect
    # the next save cleans up what the killed one left, and puts a moved-aside directory back first
    sid = prepare_partial_checkpoint(tmp_path, "other")
    assert whole_save(tmp_path, "latest") == expect
    assert sorted(os.listdir(tmp_path)) == [f".other_partial.{sid}.smp-staging", "latest_partial", "newest"]


def test_fp16_states_and_a_separate_optimizer_rankinfo(tmp_path: Path) -> None:
    sid = prepare_partial_checkpoint(tmp_path, "t")
    records: dict[str, Any] = {}
    for rdp in range(2):
        # sharded optimizer state: every rdp rank writes its optimizer shard; model files per (pp, tp)
        records.update(write_partial_checkpoint(
            tmp_path, "t", "0_0", {"m": 1} if rdp == 0 else None, {"shard": rdp}, None, CONFIG,
            write_shared=(rdp == 0), fp16_states={"master": rdp} if rdp == 0 else None,
            optimizer_rankinfo=rank_info(0, 0, rdp), save_id=sid))
    commit_partial_checkpoint(tmp_path, "t", sid, records, expected_rankinfos=["0_0"])
    assert sorted(os.listdir(tmp_path / "t_partial")) == [
        "fp16_states_0_0.pt", "model_0_0.pt", "optimizer_0_0_0.pt", "optimizer_0_0_1.pt", "smp_config.pt",
        "smp_manifest.json", "user_content.pt"]
    got = read_partial_checkpoint(tmp_path, None, "0_0", optimizer_rankinfo="0_0_1")
    assert got["optimizer"] == {"shard": 1} and got["fp16_states"] == {"master": 0} and got["model"] == {"m": 1}


def test_detect_rankinfo(tmp_path: Path) -> None:
    save(tmp_path, "two", rankinfos=("0_0", "1_0"))
    save(tmp_path, "three", rankinfos=("0_0_0", "0_0_1"))
    assert detect_rankinfo(tmp_path, "two", 1, 0, rdp_rank=1) == "1_0"
    assert detect_rankinfo(tmp_path, None, 0, 0, rdp_rank=1) == "0_0_1"
    with pytest.raises(SMPCheckpointError, match=r"no model file for rankinfo 1_1; it has \['0_0', '1_0'\]"):
        detect_rankinfo(tmp_path, "two", 1, 1)


# ----------------------------------------------------------------------------------------------
# Errors name the file or the value


@pytest.mark.parametrize("tag", ["", "newest", "a/b", "x\ny", " pad", ".hidden", "..", 5, None])
def test_bad_tags(tmp_path: Path, tag: Any) -> None:
    with pytest.raises(SMPCheckpointError, match=re.escape(repr(tag))):
        prepare_partial_checkpoint(tmp_path, tag)


def test_bad_rankinfo(tmp_path: Path) -> None:
    with pytest.raises(SMPCheckpointError, match=r"rankinfo='0-0'"):
        write_partial_checkpoint(tmp_path, "t", "0-0", {}, {}, None, CONFIG, write_shared=True, save_id="0" * 16)


def test_resume_errors_name_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(SMPCheckpointError, match=rf"no checkpoint to resume in .*{tmp_path.name}/newest does not exist"):
        read_partial_checkpoint(tmp_path, None, "0_0")
    atomic_write_text("", tmp_path / "newest")
    with pytest.raises(SMPCheckpointError, match="newest is empty"):
        read_partial_checkpoint(tmp_path, None, "0_0")
    with pytest.raises(SMPCheckpointError, match=r"checkpoint 'nope' not found: .*nope_partial does not exist"):
        read_partial_checkpoint(tmp_path, "nope", "0_0")
    save(tmp_path, "s")
    with pytest.raises(SMPCheckpointError, match=r"model_2_0.pt; it has model files for rankinfos \['0_0', '1_0'\]"):
        read_partial_checkpoint(tmp_path, "s", "2_0")
    os.remove(tmp_path / "s_partial" / "optimizer_1_0.pt")
    with pytest.raises(SMPCheckpointError, match=r"optimizer_1_0.pt.*load_optimizer=False"):
        read_partial_checkpoint(tmp_path, "s", "1_0")


def damage(file: Path, how: str) -> None:
    """Damage ``file`` as the issue found them: truncated, random bytes of the same size, emptied."""
    data = file.read_bytes()
    if how == "truncated":
        file.write_bytes(data[: len(data) // 2])
    elif how == "random":
        file.write_bytes(os.urandom(len(data)))
    else:
        file.write_bytes(b"")


DAMAGES = [("model_1_0.pt", "truncated", "1_0"), ("optimizer_0_0.pt", "random", "0_0"),
           ("smp_config.pt", "empty", "0_0")]


@pytest.mark.parametrize(("name", "how", "rankinfo"), DAMAGES)
def test_a_damaged_file_is_refused_by_name_against_the_manifest(tmp_path: Path, name: str, how: str,
                                                                rankinfo: str) -> None:
    save(tmp_path, "s1", step=1)
    save(tmp_path, "s2", step=2)
    damage(tmp_path / "s2_partial" / name, how)
    with pytest.raises(SMPCheckpointError) as e:
        read_partial_checkpoint(tmp_path, None, rankinfo)
    msg = str(e.value)
    assert str(tmp_path / "s2_partial" / name) in msg
    assert ("SHA-256" in msg and "damaged" in msg) if how == "random" else "is truncated" in msg
    assert "resume another checkpoint" in msg and "['s1']" in msg  # the fix names the intact tag
    for r in ("0_0", "1_0"):
        got = read_partial_checkpoint(tmp_path, "s1", r)
        assert got["model"]["step"] == got["optimizer"]["step"] == got["user_content"]["step"] == 1


def test_a_file_from_another_save_is_refused(tmp_path: Path) -> None:
    """The mix the issue found: one rank's optimizer state from an older save of the same tag."""
    save(tmp_path, "t", step=1)
    old = (tmp_path / "t_partial" / "optimizer_1_0.pt").read_bytes()
    save(tmp_path, "t", step=2)
    (tmp_path / "t_partial" / "optimizer_1_0.pt").write_bytes(old)  # same size: only the checksum tells
    with pytest.raises(SMPCheckpointError, match=r"optimizer_1_0.pt is damaged: its content differs"):
        read_partial_checkpoint(tmp_path, "t", "1_0")


@pytest.mark.parametrize(("name", "how", "rankinfo"), DAMAGES)
def test_without_a_manifest_torch_errors_become_errors_that_name_the_file(tmp_path: Path, name: str, how: str,
                                                                         rankinfo: str) -> None:
    """Checkpoints of SMP v1 or an earlier smp have no manifest: torch's own error, named."""
    save(tmp_path, "s", step=1)
    os.remove(tmp_path / "s_partial" / MANIFEST)
    damage(tmp_path / "s_partial" / name, how)
    with pytest.raises(SMPCheckpointError) as e:
        read_partial_checkpoint(tmp_path, "s", rankinfo)
    msg = str(e.value)
    assert str(tmp_path / "s_partial" / name) in msg and "damaged" in msg and "Fix:" in msg
    assert type(e.value.__cause__).__name__ in msg  # e.g. RuntimeError (PytorchStreamReader), UnpicklingError


def test_a_damaged_manifest_is_named(tmp_path: Path) -> None:
    save(tmp_path, "s")
    (tmp_path / "s_partial" / MANIFEST).write_text("{not json")
    with pytest.raises(SMPCheckpointError, match=r"the manifest .*s_partial/smp_manifest.json is damaged"):
        read_partial_checkpoint(tmp_path, "s", "0_0")


def test_load_file_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "model_0_0.pt"
    atomic_save({"w": torch.ones(100)}, p)
    damage(p, "truncated")
    with pytest.raises(SMPCheckpointError, match=rf"cannot read the thing {re.escape(str(p))}: .*Fix: do this"):
        ckpt.load_file(str(p), "thing", "do this")


def test_the_next_save_cleans_up_what_an_interrupted_one_left(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    save(tmp_path, "s1")
    sid = prepare_partial_checkpoint(tmp_path, "s2")  # a save that never commits...
    write_partial_checkpoint(tmp_path, "s2", "0_0", {}, {}, None, CONFIG, write_shared=True, save_id=sid)
    (tmp_path / f".newest.123.abcd{TEMP_SUFFIX}").write_bytes(b"half")  # ...and a killed atomic write
    legacy = tmp_path / "old_partial"  # left by an earlier smp that wrote in place
    legacy.mkdir()
    with caplog.at_level(logging.INFO, logger="smp.checkpoint"):
        assert save(tmp_path, "s3") == ["s1", "s3"]
    assert sorted(os.listdir(tmp_path)) == ["newest", "old_partial", "s1_partial", "s3_partial"]
    assert f".s2_partial.{sid}.smp-staging: the files of a save of s2_partial that did not finish" in caplog.text
    assert "the temp file of a write that did not finish" in caplog.text
    assert re.search(r"old_partial is not listed in .*newest: a save by an earlier smp", caplog.text)


# ----------------------------------------------------------------------------------------------
# Full checkpoints


def test_full_checkpoint_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "a" / "ckpts"  # created on demand, parents too
    write_full_checkpoint(path, "final", {"w": torch.ones(2)}, {"epoch": 3})
    write_full_checkpoint(path, "no_uc", {"w": torch.zeros(2)})
    assert sorted(os.listdir(path)) == ["final", "no_uc", "user_content_final"]
    got = read_full_checkpoint(path, "final")
    assert got["user_content"] == {"epoch": 3} and torch.equal(got["model"]["w"], torch.ones(2))
    assert read_full_checkpoint(path, "no_uc")["user_content"] is None
    assert read_newest(path) == []  # full checkpoints are not listed in newest


def test_a_damaged_full_checkpoint_is_named(tmp_path: Path) -> None:
    write_full_checkpoint(tmp_path, "final", {"w": torch.ones(100)}, {"epoch": 3})
    damage(tmp_path / "final", "truncated")
    with pytest.raises(SMPCheckpointError, match=rf"full model of checkpoint 'final' {re.escape(str(tmp_path))}/final"):
        read_full_checkpoint(tmp_path, "final")


def test_missing_full_checkpoint_points_at_the_partial_one(tmp_path: Path) -> None:
    save(tmp_path, "s")
    with pytest.raises(SMPCheckpointError, match=r"full checkpoint 's' not found.*resume it with partial=True"):
        read_full_checkpoint(tmp_path, "s")
    assert partial_dir(tmp_path, "s") == str(tmp_path / "s_partial")


def test_docstring_examples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import doctest

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the examples write under mkdtemp()
    result = doctest.testmod(ckpt)
    assert result.attempted > 0 and result.failed == 0
