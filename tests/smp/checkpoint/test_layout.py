"""smp.checkpoint.layout with a plain-Python codec: staging and commit, failed saves, newest, tags, rank infos.

Real files under tmp_path, no framework (the torch binding: tests/torch/checkpointing/test_checkpoint_files.py).
"""

from __future__ import annotations

import doctest
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from smp.checkpoint import MANIFEST, FileRecord, atomic, atomic_write, codec, layout, load_file, read_manifest
from smp.checkpoint.layout import (
    NEWEST,
    SMP_CONFIG,
    USER_CONTENT,
    check_tag,
    commit_partial_checkpoint,
    detect_rankinfo,
    full_model_path,
    full_user_content_path,
    partial_dir,
    prepare_partial_checkpoint,
    read_full_checkpoint,
    read_newest,
    read_partial_checkpoint,
    resolve_tag,
    write_full_checkpoint,
    write_partial_checkpoint,
)
from smp.errors import SMPCheckpointError

CONFIG = {"microbatches": 2}


class PickleCodec(codec.PickleCodec):
    """The core's pickle `Codec`, recording what it was asked to do (and failing on request)."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.fail_on = fail_on
        self.saved: list[str] = []
        self.load_kwargs: list[dict[str, Any]] = []

    def save(self, obj: Any, path: str) -> FileRecord:
        if self.fail_on is not None and os.path.basename(path) == self.fail_on:
            raise OSError(28, "No space left on device", path)
        self.saved.append(os.path.basename(path))
        return super().save(obj, path)

    def load(self, path: str, **kwargs: Any) -> Any:
        self.load_kwargs.append(kwargs)
        return super().load(path)


class JsonCodec:
    """A second codec: the layout does not care what the files hold."""

    name = "json"

    def save(self, obj: Any, path: str) -> FileRecord:
        return atomic_write(path, lambda f: f.write(json.dumps(obj).encode()))

    def load(self, path: str, **kwargs: Any) -> Any:
        with open(path, encoding="utf-8") as f:
            return json.load(f)


def save(path: Path, tag: str, *, step: int = 0, infos: tuple[str, ...] = ("0_0", "1_0"), keep: int | None = None,
         c: Any = None) -> list[str]:
    """A whole partial save by two ranks (``infos``), rank 0 writing the shared files."""
    c = c or PickleCodec()
    sid = prepare_partial_checkpoint(path, tag)
    records: dict[str, FileRecord] = {}
    for i, r in enumerate(infos):
        records.update(write_partial_checkpoint(c, path, tag, r, {"tag": tag, "step": step, "rank": r},
                                                {"opt": step}, {"step": step}, CONFIG, i == 0, save_id=sid))
    return commit_partial_checkpoint(path, tag, sid, records, keep, expected_rankinfos=list(infos))


def step_of(path: Path, tag: str | None, rankinfo: str = "0_0") -> int:
    got = read_partial_checkpoint(PickleCodec(), path, tag, rankinfo)
    steps = {got["model"]["step"], got["optimizer"]["opt"], got["user_content"]["step"]}
    assert len(steps) == 1, steps
    return int(steps.pop())


# ----------------------------------------------------------------------------------------------
# Staging and commit


def test_a_save_is_invisible_until_committed(tmp_path: Path) -> None:
    c = PickleCodec()
    sid = prepare_partial_checkpoint(tmp_path, "step_1")
    staging = tmp_path / f".step_1_partial.{sid}.smp-staging"
    assert sorted(os.listdir(tmp_path)) == [staging.name] and os.listdir(staging) == []
    rec = write_partial_checkpoint(c, tmp_path, "step_1", "0_0", {"w": 1}, {"m": 2}, {"epoch": 1}, CONFIG,
                                   write_shared=True, save_id=sid, fp16_states={"master": 3})
    rec.update(write_partial_checkpoint(c, tmp_path, "step_1", "1_0", {"w": 4}, None, None, None,
                                        write_shared=False, save_id=sid))
    assert sorted(rec) == ["fp16_states_0_0.pt", "model_0_0.pt", "model_1_0.pt", "optimizer_0_0.pt",
                           SMP_CONFIG, USER_CONTENT]
    assert sorted(os.listdir(staging)) == sorted(rec)
    assert not (tmp_path / "step_1_partial").exists() and read_newest(tmp_path) == []

    assert commit_partial_checkpoint(tmp_path, "step_1", sid, rec, expected_rankinfos=["0_0", "1_0"]) == ["step_1"]
    assert sorted(os.listdir(tmp_path)) == [NEWEST, "step_1_partial"]
    assert (tmp_path / NEWEST).read_text() == "step_1\n"
    manifest = read_manifest(str(tmp_path / "step_1_partial"))
    assert manifest is not None and manifest.save_id == sid and manifest.tag == "step_1" and manifest.files == rec
    got = read_partial_checkpoint(c, tmp_path, None, "0_0")
    assert got == {"tag": "step_1", "save_id": sid, "model": {"w": 1}, "optimizer": {"m": 2},
                   "fp16_states": {"master": 3}, "user_content": {"epoch": 1},
                   "config": {"microbatches": 2, "smp_version": layout._smp_version}}
    got = read_partial_checkpoint(c, tmp_path, "step_1", "1_0", optimizer_rankinfo="0_0", smp_extra=1)
    assert got["model"] == {"w": 4} and got["fp16_states"] is None
    assert c.load_kwargs[-1] == {"smp_extra": 1}  # the frontend's load options reach its codec


def test_the_layout_is_the_same_whatever_the_codec(tmp_path: Path) -> None:
    save(tmp_path / "p", "t", c=PickleCodec())
    save(tmp_path / "j", "t", c=JsonCodec())
    assert sorted(os.listdir(tmp_path / "p" / "t_partial")) == sorted(os.listdir(tmp_path / "j" / "t_partial"))
    assert read_partial_checkpoint(JsonCodec(), tmp_path / "j", None, "1_0")["model"]["rank"] == "1_0"


def test_write_needs_the_staging_directory_of_its_save(tmp_path: Path) -> None:
    with pytest.raises(SMPCheckpointError, match=r"staging directory .* does not exist on this rank.*prepare_partial"):
        write_partial_checkpoint(PickleCodec(), tmp_path, "t", "0_0", {}, {}, None, CONFIG, True,
                                 save_id="0123456789abcdef")


@pytest.mark.parametrize("rankinfo", ["0", "0_0_0_0", "a_b", "0-1", ""])
def test_rankinfo_must_be_pp_tp_or_pp_tp_rdp(tmp_path: Path, rankinfo: str) -> None:
    sid = prepare_partial_checkpoint(tmp_path, "t")
    with pytest.raises(SMPCheckpointError, match=r"must be '<pp>_<tp>' or '<pp>_<tp>_<rdp>'.*rank_info\("):
        write_partial_checkpoint(PickleCodec(), tmp_path, "t", rankinfo, {}, {}, None, CONFIG, True, save_id=sid)


def test_config_must_be_a_mapping(tmp_path: Path) -> None:
    sid = prepare_partial_checkpoint(tmp_path, "t")
    with pytest.raises(SMPCheckpointError, match=r"config=list: must be a dict of smp config keys"):
        write_partial_checkpoint(PickleCodec(), tmp_path, "t", "0_0", {}, {}, None, [1], True,  # type: ignore[arg-type]
                                 save_id=sid)


def test_commit_refuses_a_missing_or_changed_file_and_commits_nothing(tmp_path: Path) -> None:
    save(tmp_path, "step_1", step=1)
    c = PickleCodec()
    sid = prepare_partial_checkpoint(tmp_path, "step_2")
    rec = write_partial_checkpoint(c, tmp_path, "step_2", "0_0", {}, {}, None, CONFIG, True, save_id=sid)
    with pytest.raises(SMPCheckpointError) as e:
        commit_partial_checkpoint(tmp_path, "step_2", sid, rec, expected_rankinfos=["0_0", "1_0"])
    assert "missing ['model_1_0.pt']" in str(e.value) and "nothing was committed (newest still lists ['step_1'])" in str(e.value)
    staged = tmp_path / f".step_2_partial.{sid}.smp-staging" / "model_0_0.pt"
    staged.write_bytes(staged.read_bytes() + b"x")
    with pytest.raises(SMPCheckpointError, match=r"not as written \['model_0_0.pt'\]"):
        commit_partial_checkpoint(tmp_path, "step_2", sid, rec, expected_rankinfos=["0_0"])
    assert read_newest(tmp_path) == ["step_1"] and not (tmp_path / "step_2_partial").exists()
    assert step_of(tmp_path, None) == 1


# ----------------------------------------------------------------------------------------------
# A failed save leaves the previous checkpoint intact


@pytest.mark.parametrize("tag", ["step_2", "step_1"])  # a new tag, and the same tag saved again
@pytest.mark.parametrize("fail_on", ["model_1_0.pt", "optimizer_0_0.pt", USER_CONTENT, SMP_CONFIG])
def test_a_failed_write_leaves_the_previous_checkpoint_intact(tmp_path: Path, tag: str, fail_on: str) -> None:
    save(tmp_path, "step_1", step=1, keep=1)
    before = {n: (tmp_path / "step_1_partial" / n).read_bytes() for n in os.listdir(tmp_path / "step_1_partial")}
    with pytest.raises(OSError, match="No space left on device"):
        save(tmp_path, tag, step=2, keep=1, c=PickleCodec(fail_on=fail_on))
    assert read_newest(tmp_path) == ["step_1"]
    assert {n: (tmp_path / "step_1_partial" / n).read_bytes() for n in os.listdir(tmp_path / "step_1_partial")} == before
    assert step_of(tmp_path, None) == 1 and step_of(tmp_path, "step_1", "1_0") == 1
    # the retry succeeds, and the next save cleans what the failed one staged
    assert save(tmp_path, tag, step=2, keep=1) == [tag]
    assert step_of(tmp_path, None) == 2
    assert sorted(os.listdir(tmp_path)) == [NEWEST, f"{tag}_partial"]


def test_a_failed_write_of_newest_keeps_the_old_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save(tmp_path, "step_1", step=1)

    def full_disk(text: str, path: Any) -> FileRecord:
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(layout, "atomic_write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save(tmp_path, "step_2", step=2)
    monkeypatch.undo()
    # step_2 was swapped in but not listed: a resume without a tag still reads step_1
    assert read_newest(tmp_path) == ["step_1"] and step_of(tmp_path, None) == 1 and step_of(tmp_path, "step_2") == 2


# ----------------------------------------------------------------------------------------------
# newest


def test_newest_lists_committed_tags_oldest_first_and_keeps_the_last_n(tmp_path: Path) -> None:
    assert read_newest(tmp_path / "nowhere") == []
    assert save(tmp_path, "a") == ["a"]
    assert save(tmp_path, "b") == ["a", "b"]
    assert save(tmp_path, "a") == ["b", "a"]  # saved again: listed last
    assert save(tmp_path, "c", keep=2) == ["a", "c"]
    assert sorted(os.listdir(tmp_path)) == ["a_partial", "c_partial", NEWEST]
    assert save(tmp_path, "d", keep=0) == ["a", "c", "d"]  # 0 / None keep all
    (tmp_path / NEWEST).write_text("a\n\n  c \nd\n")
    assert read_newest(tmp_path) == ["a", "c", "d"]


def test_full_checkpoints_are_not_in_newest(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b"
    write_full_checkpoint(PickleCodec(), path, "final", {"w": 1}, {"epoch": 3})
    write_full_checkpoint(PickleCodec(), path, "bare", {"w": 2})
    assert sorted(os.listdir(path)) == ["bare", "final", "user_content_final"] and read_newest(path) == []
    assert full_model_path(path, "final") == str(path / "final")
    assert full_user_content_path(path, "final") == str(path / "user_content_final")
    assert read_full_checkpoint(PickleCodec(), path, "final") == {"tag": "final", "model": {"w": 1},
                                                                  "user_content": {"epoch": 3}}
    assert read_full_checkpoint(PickleCodec(), path, "bare")["user_content"] is None


def test_a_missing_full_checkpoint_points_at_the_partial_one(tmp_path: Path) -> None:
    save(tmp_path, "s")
    with pytest.raises(SMPCheckpointError, match=r"full checkpoint 's' not found: .*/s does not exist; .*s_partial "
                                                 r"exists, so resume it with partial=True"):
        read_full_checkpoint(PickleCodec(), tmp_path, "s")
    assert partial_dir(tmp_path, "s") == str(tmp_path / "s_partial")


# ----------------------------------------------------------------------------------------------
# Tags


@pytest.mark.parametrize("tag", ["step_1", "a.b", "x y", "ümlaut", "a..b"])
def test_good_tags(tag: str) -> None:
    assert check_tag(tag) == tag


@pytest.mark.parametrize("tag", ["", ".", "..", NEWEST, ".hidden", " step", "step ", "a/b", "a\nb", "a\rb"])
def test_bad_tags_name_the_rule(tag: str) -> None:
    with pytest.raises(SMPCheckpointError, match=r"cannot be used: a tag names files.*Fix: e.g. tag=f'step_\{step\}'"):
        check_tag(tag)


@pytest.mark.parametrize("tag", [3, None, b"t"])
def test_a_tag_must_be_a_str(tag: object) -> None:
    with pytest.raises(SMPCheckpointError, match=rf"tag={tag!r} is a {type(tag).__name__}; it must be a str"):
        check_tag(tag)


def test_resolve_tag_reads_the_last_line_of_newest(tmp_path: Path) -> None:
    with pytest.raises(SMPCheckpointError, match=r"no checkpoint to resume in .*newest does not exist"):
        resolve_tag(tmp_path, None)
    (tmp_path / NEWEST).write_text("\n")
    with pytest.raises(SMPCheckpointError, match=r"newest is empty. Fix: pass the directory given to smp.save_checkpoint"):
        resolve_tag(tmp_path, None)
    save(tmp_path, "a", step=1)
    save(tmp_path, "b", step=2)
    assert resolve_tag(tmp_path, None) == "b" and resolve_tag(str(tmp_path), "a") == "a"
    assert resolve_tag(tmp_path, "not_saved") == "not_saved"  # an explicit tag is only checked for form
    with pytest.raises(SMPCheckpointError, match="cannot be used"):
        resolve_tag(tmp_path, "../b")
    assert step_of(tmp_path, None) == 2 and step_of(tmp_path, "a") == 1


def test_reading_an_unknown_tag_lists_the_saved_ones(tmp_path: Path) -> None:
    save(tmp_path, "a")
    with pytest.raises(SMPCheckpointError, match=r"checkpoint 'zz' not found: .*zz_partial does not exist .*\['a'\]"):
        read_partial_checkpoint(PickleCodec(), tmp_path, "zz", "0_0")


# ----------------------------------------------------------------------------------------------
# Rank infos


def test_detect_rankinfo_prefers_pp_tp_rdp_then_pp_tp(tmp_path: Path) -> None:
    save(tmp_path, "v2", infos=("0_0", "1_0"))
    save(tmp_path, "v3", infos=("0_0_0", "0_0_1"))
    assert detect_rankinfo(tmp_path, "v2", 1, 0) == "1_0"
    assert detect_rankinfo(tmp_path, "v2", 1, 0, rdp_rank=1) == "1_0"  # no per-rdp file: the (pp, tp) one
    assert detect_rankinfo(tmp_path, None, 0, 0, rdp_rank=1) == "0_0_1"  # None: newest's last tag, v3
    with pytest.raises(SMPCheckpointError) as e:
        detect_rankinfo(tmp_path, "v3", 0, 1, rdp_rank=0)
    assert "has no model file for rankinfo 0_1_0 or 0_1; it has ['0_0_0', '0_0_1']" in str(e.value)
    assert "Fix: resume with the pipeline/tensor parallel degrees" in str(e.value)


def test_a_rank_of_another_layout_is_refused_by_name(tmp_path: Path) -> None:
    save(tmp_path, "t", infos=("0_0", "1_0"))
    with pytest.raises(SMPCheckpointError, match=r"has no .*model_2_0.pt; it has model files for rankinfos "
                                                 r"\['0_0', '1_0'\]"):
        read_partial_checkpoint(PickleCodec(), tmp_path, "t", "2_0")
    with pytest.raises(SMPCheckpointError, match=r"has no .*optimizer_0_0_3.pt. Fix: resume with load_optimizer=False"):
        read_partial_checkpoint(PickleCodec(), tmp_path, "t", "0_0", optimizer_rankinfo="0_0_3")
    got = read_partial_checkpoint(PickleCodec(), tmp_path, "t", "0_0", optimizer_rankinfo="0_0_3",
                                  load_optimizer=False)
    assert got["optimizer"] is None and got["model"]["rank"] == "0_0"


# ----------------------------------------------------------------------------------------------
# Checked reads


def test_a_changed_file_is_refused_with_the_other_tags_as_the_fix(tmp_path: Path) -> None:
    save(tmp_path, "a")
    save(tmp_path, "b")
    model = tmp_path / "b_partial" / "model_1_0.pt"
    model.write_bytes(model.read_bytes()[:-1])
    with pytest.raises(SMPCheckpointError) as e:
        read_partial_checkpoint(PickleCodec(), tmp_path, None, "1_0")
    msg = str(e.value)
    assert f"cannot read the model state of checkpoint 'b': {model} is truncated" in msg
    assert "Fix: resume another checkpoint of" in msg and "(listed in newest: ['a'])" in msg


def test_a_load_failure_names_the_codec(tmp_path: Path) -> None:
    class Broken(PickleCodec):
        def load(self, path: str, **kwargs: Any) -> Any:
            raise ModuleNotFoundError("No module named 'mymodel'")

    save(tmp_path, "a")
    with pytest.raises(SMPCheckpointError, match=r"ModuleNotFoundError: .*checked against smp_manifest.json\), but "
                                                 r"pickle.load fails: the saved objects need code"):
        read_partial_checkpoint(Broken(), tmp_path, None, "0_0")
    os.remove(tmp_path / "a_partial" / MANIFEST)  # an unchecked (SMP v1) checkpoint
    with pytest.raises(SMPCheckpointError, match=r"the file is damaged \(truncated, overwritten or not written by "
                                                 r"pickle.save\)"):
        read_partial_checkpoint(Broken(), tmp_path, None, "0_0")
    assert read_partial_checkpoint(PickleCodec(), tmp_path, None, "0_0")["save_id"] is None


def test_load_file_names_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SMPCheckpointError, match=r"cannot read the thing: .*nope does not exist. Fix: do this"):
        load_file(PickleCodec(), str(tmp_path / "nope"), "thing", "do this")


# ----------------------------------------------------------------------------------------------
# Docstring examples


@pytest.mark.parametrize("module", [atomic, codec, layout], ids=lambda m: m.__name__)
def test_docstring_examples(module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the examples write under mkdtemp()
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
