#!/usr/bin/env python3
"""The GPU kit's pieces: split files into pieces of at most N bytes with a manifest of sha256
sums, stage pieces as device calls bring them, join them back and check every sum.

Standard library only: the same code runs here (scripts/gpu_kit.py, tests/test_gpu_kit.py) and
on the GPU machine (scripts/gpu_kit_run.sh), whose Python has nothing of this project.

    gpu_kit_pieces.py split OUT_DIR PIECE_BYTES FILE...  [--contents DIR]
    gpu_kit_pieces.py stage FROM_DIR STASH_DIR    # move FROM_DIR's pieces that match the
                                                  # manifest to STASH_DIR; exit 3, naming
                                                  # them, while some are still missing
    gpu_kit_pieces.py join STASH_DIR DEST_DIR     # every piece checked, every file rebuilt
                                                  # and checked
    gpu_kit_pieces.py contents STASH_DIR ROOT     # the files unpacked under ROOT, checked

manifest.json: {"piece_bytes": N, "files": [{"name", "size", "sha256", "pieces": [{"name",
"size", "sha256"}, ...]}, ...], "contents": {path: {"size", "sha256"}, ...}}. "contents" (with
--contents DIR) lists the files inside the split ones (the kit's wheels and models, packed in
kit.tar.xz), so they are checked again once unpacked.
"""

import hashlib
import json
import shutil
import sys
from pathlib import Path

MANIFEST = "manifest.json"
CHUNK = 1 << 20


class PieceError(Exception):
    """A missing or corrupted piece or file: the message names it and what to do."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def piece_names(name: str, count: int) -> list[str]:
    return [f"{name}.{i:03d}" for i in range(count)]


def split(out_dir: Path, piece_bytes: int, files: list[Path], contents: Path | None = None) -> dict:
    """Each file in pieces of at most piece_bytes under out_dir, and out_dir/manifest.json."""
    if piece_bytes < 1:
        raise PieceError(f"piece size {piece_bytes} bytes: it must be at least 1")
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"piece_bytes": piece_bytes, "files": [], "contents": {}}
    for src in files:
        entry = {"name": src.name, "size": src.stat().st_size, "sha256": sha256_file(src),
                 "pieces": []}
        count = max(1, -(-entry["size"] // piece_bytes))
        with src.open("rb") as f:
            for name in piece_names(src.name, count):
                h, size = hashlib.sha256(), 0
                with (out_dir / name).open("wb") as out:
                    while size < piece_bytes and (chunk := f.read(min(CHUNK, piece_bytes - size))):
                        out.write(chunk)
                        h.update(chunk)
                        size += len(chunk)
                entry["pieces"].append({"name": name, "size": size, "sha256": h.hexdigest()})
        manifest["files"].append(entry)
    if contents is not None:
        manifest["contents"] = {
            str(p.relative_to(contents)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(contents.rglob("*")) if p.is_file()}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def load_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise PieceError(f"no {MANIFEST} in {folder}: carry build/gpu-kit/pieces/{MANIFEST} "
                         "in the call (it comes with every piece)")
    return json.loads(path.read_text())


def all_pieces(manifest: dict) -> list[dict]:
    return [p for f in manifest["files"] for p in f["pieces"]]


def check_piece(folder: Path, piece: dict) -> str | None:
    """None when folder holds the piece intact, else what is wrong, as a sentence."""
    path = folder / piece["name"]
    if not path.is_file():
        return (f"piece {piece['name']} is missing from {folder}: stage it (a call that "
                f"carries build/gpu-kit/pieces/{piece['name']})")
    size, digest = path.stat().st_size, sha256_file(path)
    if (size, digest) != (piece["size"], piece["sha256"]):
        return (f"piece {piece['name']} in {folder} is corrupted ({size} bytes, sha256 "
                f"{digest[:16]}; the manifest says {piece['size']} bytes, {piece['sha256'][:16]}): "
                "stage it again")
    return None


def stage(src: Path, stash: Path) -> list[str]:
    """Move src's pieces that the manifest knows and that are intact into stash (the
    manifest too); returns what stash still lacks, a sentence per piece (missing, or
    corrupted since). A corrupted carried piece is an error."""
    stash.mkdir(parents=True, exist_ok=True)
    manifest = load_manifest(src if (src / MANIFEST).is_file() else stash)
    if (src / MANIFEST).is_file():
        old = stash / MANIFEST
        if old.is_file() and json.loads(old.read_text()) != manifest:
            for p in stash.iterdir():  # another kit's pieces: start over
                p.unlink() if p.is_file() else shutil.rmtree(p)
        shutil.copy(src / MANIFEST, stash / MANIFEST)
    for piece in all_pieces(manifest):
        if (src / piece["name"]).is_file():
            problem = check_piece(src, piece)
            if problem:
                raise PieceError(problem)
            shutil.move(str(src / piece["name"]), stash / piece["name"])
    return [pr for p in all_pieces(manifest) if (pr := check_piece(stash, p))]


def join(stash: Path, dest: Path) -> list[Path]:
    """Every file of the manifest rebuilt in dest from stash's pieces, each piece and each
    file checked against its sum."""
    manifest = load_manifest(stash)
    problems = [pr for p in all_pieces(manifest) if (pr := check_piece(stash, p))]
    if problems:
        raise PieceError("; ".join(problems))
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for entry in manifest["files"]:
        target = dest / entry["name"]
        with target.open("wb") as f:
            for piece in entry["pieces"]:
                with (stash / piece["name"]).open("rb") as p:
                    shutil.copyfileobj(p, f, CHUNK)
        digest = sha256_file(target)
        if digest != entry["sha256"]:
            raise PieceError(f"{entry['name']} joined from its pieces has sha256 {digest[:16]}, "
                             f"the manifest says {entry['sha256'][:16]}: the pieces are from "
                             "another kit; rebuild it (make gpu-kit) and stage them all again")
        out.append(target)
    return out


def check_contents(stash: Path, root: Path) -> int:
    """The unpacked files under root against the manifest's contents; returns their count."""
    manifest = load_manifest(stash)
    bad = []
    for rel, want in manifest["contents"].items():
        path = root / rel
        if not path.is_file():
            bad.append(f"{rel} is missing")
        elif (path.stat().st_size, sha256_file(path)) != (want["size"], want["sha256"]):
            bad.append(f"{rel} differs from the manifest")
    if bad:
        raise PieceError(f"unpacked under {root}: {'; '.join(bad[:5])}"
                         + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else "")
                         + ": unpack the kit again")
    return len(manifest["contents"])


def main(argv: list[str]) -> int:
    usage = __doc__.split("\n\n")[2]
    try:
        if argv[:1] == ["split"] and len(argv) >= 4:
            contents = None
            if "--contents" in argv:
                i = argv.index("--contents")
                contents, argv = Path(argv[i + 1]), argv[:i] + argv[i + 2:]
            m = split(Path(argv[1]), int(argv[2]), [Path(a) for a in argv[3:]], contents)
            print(f"{sum(len(f['pieces']) for f in m['files'])} piece(s) in {argv[1]}")
        elif argv[:1] == ["stage"] and len(argv) == 3:
            lacking = stage(Path(argv[1]), Path(argv[2]))
            total = len(all_pieces(load_manifest(Path(argv[2]))))
            print(f"{total - len(lacking)} of {total} piece(s) staged in {argv[2]}")
            for problem in lacking:
                print(f"  {problem}")
            return 3 if lacking else 0
        elif argv[:1] == ["join"] and len(argv) == 3:
            for p in join(Path(argv[1]), Path(argv[2])):
                print(f"{p}: sha256 ok")
        elif argv[:1] == ["contents"] and len(argv) == 3:
            print(f"{check_contents(Path(argv[1]), Path(argv[2]))} file(s) under {argv[2]}: "
                  "sha256 ok")
        else:
            print(f"usage:\n{usage}", file=sys.stderr)
            return 2
    except PieceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
