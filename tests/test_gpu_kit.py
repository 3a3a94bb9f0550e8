"""The GPU kit's pieces (scripts/gpu_kit_pieces.py), on small synthetic files with tiny pieces:
the split and its manifest, staging one carried piece per call through scripts/gpu_kit_run.sh,
the join the runner does, and a corrupted, missing or foreign piece failing with a sentence
that names it. Nothing is downloaded; the real kit is built by hand (`make gpu-kit`)."""

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile

import pytest
from conftest import ROOT

import _lib
import gpu_kit
import gpu_kit_pieces as pieces

PIECE = 7  # bytes


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def kit(tmp_path):
    """Three files (empty, exactly two pieces, and a ragged tail) split into PIECE-byte pieces,
    with the manifest listing the files of a small tree as contents."""
    src = tmp_path / "src"
    src.mkdir()
    data = {"empty.bin": b"", "even.bin": b"x" * (2 * PIECE), "kit.tar.xz": bytes(range(40))}
    for name, blob in data.items():
        (src / name).write_bytes(blob)
    tree = tmp_path / "tree"
    (tree / "wheels").mkdir(parents=True)
    (tree / "wheels" / "a.whl").write_bytes(b"wheel")
    (tree / "models" / "m").mkdir(parents=True)
    (tree / "models" / "m" / "config.json").write_text("{}")
    out = tmp_path / "pieces"
    manifest = pieces.split(out, PIECE, [src / n for n in data], contents=tree)
    return data, out, manifest, tree


def cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_kit_pieces.py"), *args],
                          capture_output=True, text=True)


def test_split_writes_pieces_no_larger_than_asked_and_a_manifest_of_sums(kit):
    data, out, manifest, _ = kit
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert manifest["piece_bytes"] == PIECE
    for entry in manifest["files"]:
        blob = data[entry["name"]]
        assert (entry["size"], entry["sha256"]) == (len(blob), sha(blob))
        assert len(entry["pieces"]) == max(1, -(-len(blob) // PIECE))
        joined = b""
        for p in entry["pieces"]:
            part = (out / p["name"]).read_bytes()
            assert len(part) == p["size"] <= PIECE and p["sha256"] == sha(part)
            joined += part
        assert joined == blob
    assert manifest["contents"]["wheels/a.whl"] == {"size": 5, "sha256": sha(b"wheel")}
    assert set(manifest["contents"]) == {"wheels/a.whl", "models/m/config.json"}


def test_join_rebuilds_every_file_and_checks_the_unpacked_contents(kit, tmp_path):
    data, out, _, tree = kit
    r = cli("join", str(out), str(tmp_path / "joined"))
    assert r.returncode == 0, r.stderr
    for name, blob in data.items():
        assert (tmp_path / "joined" / name).read_bytes() == blob
    r = cli("contents", str(out), str(tree))
    assert r.returncode == 0 and "2 file(s)" in r.stdout, r.stderr
    (tree / "wheels" / "a.whl").write_bytes(b"wheeL")
    r = cli("contents", str(out), str(tree))
    assert r.returncode == 2 and "wheels/a.whl differs from the manifest" in r.stderr


def test_a_corrupted_piece_fails_with_its_name(kit, tmp_path):
    _, out, manifest, _ = kit
    name = manifest["files"][2]["pieces"][1]["name"]
    blob = bytearray((out / name).read_bytes())
    blob[0] ^= 0xFF
    (out / name).write_bytes(bytes(blob))
    r = cli("join", str(out), str(tmp_path / "joined"))
    assert r.returncode == 2
    assert f"piece {name}" in r.stderr and "is corrupted" in r.stderr
    assert "stage it again" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "joined" / "kit.tar.xz").exists()


def test_a_missing_piece_fails_with_its_name(kit, tmp_path):
    _, out, manifest, _ = kit
    name = manifest["files"][1]["pieces"][0]["name"]
    (out / name).unlink()
    r = cli("join", str(out), str(tmp_path / "joined"))
    assert r.returncode == 2
    assert f"piece {name} is missing" in r.stderr
    assert f"carries build/gpu-kit/pieces/{name}" in r.stderr


def test_pieces_of_another_kit_fail_the_whole_file_sum(kit, tmp_path):
    _, out, manifest, _ = kit
    manifest["files"][2]["sha256"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(pieces.PieceError, match=r"kit.tar.xz joined from its pieces has sha256"):
        pieces.join(out, tmp_path / "joined")


def fake_root(tmp_path):
    """The runner's layout: its two scripts, and the carried folder a call brings."""
    root = tmp_path / "root"
    (root / "scripts").mkdir(parents=True)
    for name in ("gpu_kit_run.sh", "gpu_kit_pieces.py"):
        shutil.copy(ROOT / "scripts" / name, root / "scripts" / name)
    carried = root / "build" / "gpu-kit" / "pieces"
    carried.mkdir(parents=True)
    return root, carried


def run_sh(root, home):
    return subprocess.run(["bash", str(root / "scripts" / "gpu_kit_run.sh")],
                          env={"PATH": "/usr/bin:/bin", "GPU_KIT_HOME": str(home),
                               "GPU_KIT_PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=120)


def test_the_runner_stages_one_carried_piece_per_call(kit, tmp_path):
    _, out, manifest, _ = kit
    root, carried = fake_root(tmp_path)
    home = tmp_path / "home"
    names = [p["name"] for f in manifest["files"] for p in f["pieces"]]
    for i, name in enumerate(names[:-1], 1):
        shutil.copy(out / "manifest.json", carried)
        shutil.copy(out / name, carried)
        r = run_sh(root, home)
        assert r.returncode == 0, r.stderr
        assert f"{i} of {len(names)} piece(s) staged" in r.stdout
        assert not (carried / name).exists() and (home / "pieces" / name).is_file()
    # the last piece arrives, but one staged earlier was damaged meanwhile: the runner says
    # so and stops; once it is carried again, it joins the pieces and goes on (to unpack
    # kit.tar.xz, which is no archive here)
    victim = home / "pieces" / names[0]
    victim.write_bytes(b"?" + victim.read_bytes()[1:])
    shutil.copy(out / names[-1], carried)
    r = run_sh(root, home)
    assert r.returncode == 0, r.stderr
    assert f"{len(names) - 1} of {len(names)} piece(s) staged" in r.stdout
    assert f"piece {names[0]}" in r.stdout and "is corrupted" in r.stdout
    assert "stage it again" in r.stdout and "joining" not in r.stdout
    shutil.copy(out / names[0], carried)
    r = run_sh(root, home)
    assert f"{len(names)} of {len(names)} piece(s) staged" in r.stdout
    assert "joining the pieces" in r.stdout and "kit.tar.xz: sha256 ok" in r.stdout
    assert r.returncode == 2 and "unpacking" in r.stderr


def test_a_carried_piece_that_does_not_match_the_manifest_is_refused(kit, tmp_path):
    _, out, manifest, _ = kit
    root, carried = fake_root(tmp_path)
    name = manifest["files"][1]["pieces"][1]["name"]
    shutil.copy(out / "manifest.json", carried)
    (carried / name).write_bytes(b"y" * PIECE)
    r = run_sh(root, tmp_path / "home")
    assert r.returncode == 2
    assert f"piece {name}" in r.stderr and "corrupted" in r.stderr


def test_a_real_pack_round_trips_through_tar_xz(tmp_path):
    """The shape of the real kit: stage/ packed as kit.tar.xz, split, joined, unpacked with
    Python's tarfile as the runner does without an xz program, and every file checked."""
    stage = tmp_path / "stage"
    (stage / "wheels").mkdir(parents=True)
    (stage / "wheels" / "w.whl").write_bytes(bytes(range(256)) * 40)
    (stage / "models").mkdir()
    (stage / "models" / "config.json").write_text('{"a": 1}')
    pack = tmp_path / "kit.tar.xz"
    with tarfile.open(pack, "w:xz") as t:
        for part in ("wheels", "models"):
            t.add(stage / part, arcname=part)
    pieces.split(tmp_path / "pieces", 100, [pack], contents=stage)
    pieces.join(tmp_path / "pieces", tmp_path / "joined")
    with tarfile.open(tmp_path / "joined" / "kit.tar.xz") as t:
        t.extractall(tmp_path / "kit", filter="data")
    assert pieces.check_contents(tmp_path / "pieces", tmp_path / "kit") == 2


def test_a_piece_and_the_working_tree_fit_one_call(monkeypatch):
    mib = gpu_kit.MIB
    tree = 5 * mib
    size = gpu_kit.piece_bytes(tree)
    assert size <= gpu_kit.MAX_PIECE_MIB * mib
    assert tree + size + gpu_kit.MARGIN_MIB * mib <= gpu_kit.CALL_MIB * mib
    monkeypatch.setenv("GPU_KIT_PIECE_MIB", "60")
    with pytest.raises(_lib.UserError, match=r"GPU_KIT_PIECE_MIB=60: .* set it to at most 57"):
        gpu_kit.piece_bytes(tree)
    monkeypatch.setenv("GPU_KIT_PIECE_MIB", "20")
    assert gpu_kit.piece_bytes(tree) == 20 * mib
