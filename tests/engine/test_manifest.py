"""Folder manifests (sizes + CRC-32, written last) and pickle-free state files (tensors + JSON skeleton)."""

from __future__ import annotations

import json
import os
import random
import zlib

import numpy as np
import pytest
import torch
from alignopsd.engine.checkpoint import manifest as mf
from alignopsd.engine.checkpoint.statefile import flatten_state, load_state, save_state, unflatten_state


def _folder(tmp_path):
    d = tmp_path / "ck"
    (d / "sub").mkdir(parents=True)
    (d / "a.bin").write_bytes(os.urandom(3 * 1024 * 1024 + 7))
    (d / "sub" / "b.txt").write_text("hello")
    (d / ".metadata").write_bytes(b"\x80\x04library-owned pickle")
    return d


def test_manifest_lists_every_file_and_verifies(tmp_path):
    d = _folder(tmp_path)
    mf.write_manifest(d)
    files = json.loads((d / mf.MANIFEST).read_text())["files"]
    assert set(files) == {"a.bin", "sub/b.txt", ".metadata"}
    assert files["sub/b.txt"] == {"size": 5, "crc32": f"{zlib.crc32(b'hello'):08x}"}
    assert set(mf.verify_manifest(d)) == set(files)


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        ("flip", "'a.bin' is corrupted"),
        ("truncate", "'a.bin' has"),
        ("delete", "'a.bin' is missing"),
        ("metadata", "'.metadata' is corrupted"),
    ],
)
def test_damage_is_named(tmp_path, damage, match):
    d = _folder(tmp_path)
    mf.write_manifest(d)
    if damage == "flip":
        raw = bytearray((d / "a.bin").read_bytes())
        raw[4096:8192] = bytes(b ^ 0xFF for b in raw[4096:8192])
        (d / "a.bin").write_bytes(bytes(raw))
    elif damage == "truncate":
        (d / "a.bin").write_bytes((d / "a.bin").read_bytes()[:-1])
    elif damage == "delete":
        (d / "a.bin").unlink()
    else:
        (d / ".metadata").write_bytes(b"\x80\x04library-owned picklE")
    with pytest.raises(mf.ManifestError, match=match):
        mf.verify_manifest(d)
    if damage in ("flip", "metadata"):  # same size: only the checksum sees it
        mf.verify_manifest(d, checksums=False)


def test_manifest_absent_malformed_and_required(tmp_path):
    d = _folder(tmp_path)
    with pytest.raises(mf.ManifestError, match="no manifest.json"):
        mf.verify_manifest(d)
    (d / mf.MANIFEST).write_text("{")
    with pytest.raises(mf.ManifestError, match="unreadable"):
        mf.verify_manifest(d)
    mf.write_manifest(d)
    with pytest.raises(mf.ManifestError, match="'optimizer.safetensors' is not listed"):
        mf.verify_manifest(d, require=("optimizer.safetensors",))
    body = json.loads((d / mf.MANIFEST).read_text())
    body["files"]["../escape"] = {"size": 1, "crc32": "00000000"}
    (d / mf.MANIFEST).write_text(json.dumps(body))
    with pytest.raises(mf.ManifestError, match="'../escape', which is not a plain path inside the folder"):
        mf.verify_manifest(d)
    del body["files"]["../escape"]
    body["files"]["w.bin"] = {"size": True, "crc32": "00000000"}
    (d / mf.MANIFEST).write_text(json.dumps(body))
    with pytest.raises(mf.ManifestError, match="malformed entry for 'w.bin'"):
        mf.verify_manifest(d)


def test_entries_from_other_writers_are_used_and_checked(tmp_path):
    d = _folder(tmp_path)
    theirs = {"sub/b.txt": mf.file_entry(d / "sub" / "b.txt")}
    mf.write_manifest(d, theirs)
    mf.verify_manifest(d)
    with pytest.raises(mf.ManifestError, match="another rank"):
        mf.write_manifest(d, {"rng_rank1.safetensors": {"size": 1, "crc32": "0"}})


def test_dcp_folder(tmp_path):
    """A torch.distributed.checkpoint folder: its .metadata (unpickled by torch) is verified before dcp.load."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.randn(8, 4), "opt": {"step": torch.tensor(3.0)}}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    mf.write_manifest(tmp_path / "dcp")
    assert ".metadata" in mf.verify_manifest(tmp_path / "dcp")
    meta = tmp_path / "dcp" / ".metadata"
    raw = bytearray(meta.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    meta.write_bytes(bytes(raw))
    with pytest.raises(mf.ManifestError, match="'.metadata' is corrupted"):
        mf.verify_manifest(tmp_path / "dcp")


def test_atomic_write_keeps_the_old_file_when_interrupted(tmp_path, monkeypatch):
    p = tmp_path / "span_lengths.json"
    mf.atomic_write_bytes(p, b"[1, 2, 3]")

    def killed(*a, **k):
        raise KeyboardInterrupt("killed before the rename")

    monkeypatch.setattr(mf.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        mf.atomic_write_bytes(p, b"[1, 2, 3, 4]")
    assert p.read_bytes() == b"[1, 2, 3]"


def test_state_round_trip_is_exact(tmp_path):
    """Adam + LambdaLR state, RNG states: identical after a pickle-free round trip (types included)."""
    model = torch.nn.Linear(5, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    for _ in range(3):
        model(torch.randn(2, 5)).square().sum().backward()
        opt.step()
        sch.step()
    random.seed(5)
    np.random.seed(5)
    obj = {
        "optimizer": opt.state_dict(),
        "scheduler": sch.state_dict(),
        "steps": 3,
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        "odd": [float("inf"), None, True, 1e-300, (1, "x")],
    }
    save_state(tmp_path / "s.safetensors", obj)
    back = load_state(tmp_path / "s.safetensors")
    assert back["optimizer"]["param_groups"] == obj["optimizer"]["param_groups"]
    assert isinstance(back["optimizer"]["param_groups"][0]["betas"], tuple)
    assert set(back["optimizer"]["state"]) == {0, 1}
    for pid, st in obj["optimizer"]["state"].items():
        for k, v in st.items():
            got = back["optimizer"]["state"][pid][k]
            assert torch.equal(got, v) and got.dtype == v.dtype
    assert back["scheduler"] == obj["scheduler"] and back["steps"] == 3 and back["odd"] == obj["odd"]
    assert back["rng"]["python"] == obj["rng"]["python"]
    n0, n1 = obj["rng"]["numpy"], back["rng"]["numpy"]
    assert n1[0] == n0[0] and np.array_equal(n1[1], n0[1]) and n1[1].dtype == n0[1].dtype and n1[2:] == n0[2:]
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt2.load_state_dict(back["optimizer"])  # torch accepts it


def test_state_refuses_what_needs_pickle(tmp_path):
    with pytest.raises(ValueError, match=r"state\['f'\]: a function"):
        flatten_state({"f": lambda: 0})
    with pytest.raises(ValueError, match="key"):
        flatten_state({(1, 2): 0})
    with pytest.raises(ValueError, match="missing"):
        unflatten_state({"t": "t9"}, {})
    (tmp_path / "x.safetensors").write_bytes(b"\x80\x04garbage")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_state(tmp_path / "x.safetensors")


def test_state_with_one_tensor_under_two_names(tmp_path):
    """Tied weights (embedding and head: one tensor under two keys) round-trip as two equal tensors."""
    w = torch.randn(4, 3)
    save_state(tmp_path / "tied.safetensors", {"embed": w, "head": w, "view": w[1:]})
    back = load_state(tmp_path / "tied.safetensors")
    assert torch.equal(back["embed"], w) and torch.equal(back["head"], w) and torch.equal(back["view"], w[1:])
