# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Start-up checks of what the fs tier trusts: its root directory and its
key.

The tier's files are users' KV blocks, served to every request that shares
their prefix. Whoever can write into the root (or rename one of its
parents) can replace the tree with their own and have their bytes served
as a prefix's KV. So, as OpenSSH's
StrictModes and PostgreSQL's data-directory check do, the root and each of
its parents must be

- owned by the engine's user or by root (uid 0), and
- writable by nobody else: not by others, and not by the group unless the
  tier shares its root with a group (group_access) and the engine's user
  is a member of that group (any other group's members are strangers to
  the engine, however its mode reads); a parent with the
  sticky bit (/tmp) is fine, as only an entry's owner may then rename or
  remove it. The root itself gets no such exemption: in a sticky,
  world-writable root (1777) anyone can still create entries, so they
  could pre-create the tier's directories and plant config.json and block
  files there.

A root that fails is refused with a ValueError that names the path, its
mode and owner, and the fix, before the tier creates or starts anything.
A root that does not exist yet is checked from its nearest existing parent,
then created 0700 (2770 with group_access) and checked again: a directory
or link another user puts in its place meanwhile is refused, not used.
Symbolic links in the root's path are resolved first, and the resolved root
is returned: the tier uses that path, so the directories checked are the
ones it uses, even if a link in root_dir's path is repointed later.

The key (the tier config's "key_file", optional) makes a shared root a
keyed namespace: engines with the same key share blocks, others - and
anyone with write access to the store but not the key - cannot compute
where a prefix's block lives, test whether it is cached, or plant one that
loads. It is read from a file (never inline in the config or the command
line, which ps and the logs show) that must be private: owned by the
engine's user or root, not readable by others (nor by the group unless
group_access and the engine's user is in that group), and at least
MIN_KEY_BYTES long. Two keys are derived from
it (HKDF-SHA256, RFC 5869): one names the files, one MACs the blocks. The
key and what is derived from it are never logged or written anywhere.
"""

import errno
import hashlib
import hmac
import os
import pwd
import stat

# The modes of the root directories this module creates: private, or with
# group_access the group's (setgid, group-writable), as the tier's own.
_DIR_MODE = 0o700
_GROUP_DIR_MODE = 0o2770


def _owner_name(uid: int) -> str:
    try:
        return f"{uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return str(uid)


def _engine_groups() -> set[int]:
    return {os.getegid(), *os.getgroups()}


def _unsafe_reason(
    st: os.stat_result, path: str, group_access: bool, is_root: bool
) -> tuple[str, str] | None:
    """Why the directory *path* with stat *st* (the root itself if
    *is_root*, else one of its parents) cannot be trusted, and the fix: a
    (reason, fix) pair, or None."""
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory", "use a root_dir that is a directory"
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        return "is owned by another user", (
            f"run the engine as that user, or use a root_dir owned by "
            f"uid {uid} (chown {uid} {path})"
        )
    if st.st_mode & stat.S_ISVTX and not is_root:
        return None  # only an entry's owner may rename or remove it
    chmod_fix = (
        "use a root_dir whose directories only the engine's user (and with "
        "group_access its group) can write"
    )
    if st.st_mode & stat.S_IWOTH:
        if st.st_mode & stat.S_ISVTX:
            # a shared scratch directory such as /tmp or /dev/shm: not to chmod
            return (
                "is writable by all users (the sticky bit does not stop them "
                "creating the tier's directories and files in it)"
            ), (
                "use a directory in it as root_dir, e.g. "
                f"{os.path.join(path, 'vllm-kv')} (the tier creates it)"
            )
        fix = f"chmod {'o-w' if group_access else 'go-w'} {path}, or {chmod_fix}"
        return "is writable by all users", fix
    if st.st_mode & stat.S_IWGRP:
        if not group_access:
            return "is writable by its group", (
                f"chmod g-w {path}, or {chmod_fix}; or set the tier's "
                "'group_access': true"
            )
        if st.st_gid not in _engine_groups():
            return (
                f"is writable by its group {st.st_gid}, which the engine's user "
                "is not a member of"
            ), (
                f"chgrp {os.getegid()} {path} (a group of the engine's "
                f"user), or chmod g-w {path}"
            )
    return None


def _check_dir(
    root_dir: str, tier_type: str, group_access: bool, path: str, is_root: bool
) -> bool:
    """Raise unless the directory *path* (the resolved root if *is_root*,
    else one of its parents) is safe; False if nothing is there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        # still an OSError, as for a root_dir the tier cannot create
        raise OSError(
            e.errno,
            f"root_dir {root_dir!r} of the '{tier_type}' tier cannot be "
            f"checked: {path}: {e.strerror}. Fix: use a root_dir whose "
            "parents are directories the engine's user can search",
        ) from None
    what = "root_dir" if is_root else "a parent"
    if stat.S_ISLNK(st.st_mode):
        # resolved before the check: a link now is one put there meanwhile
        raise ValueError(
            f"root_dir {root_dir!r} of the '{tier_type}' tier is unsafe: "
            f"{what}, {path}, became a symbolic link while it was checked. "
            "Fix: remove the link, or use a root_dir whose parents only the "
            "engine's user can change"
        )
    unsafe = _unsafe_reason(st, path, group_access, is_root)
    if unsafe is not None:
        reason, fix = unsafe
        mode = stat.S_IMODE(st.st_mode)
        raise ValueError(
            f"root_dir {root_dir!r} of the '{tier_type}' tier is unsafe: "
            f"{what}, {path} (mode {mode:04o}, owner uid "
            f"{_owner_name(st.st_uid)}), {reason}, who could replace or "
            f"plant the cached KV blocks. Fix: {fix}"
        )
    return True


def check_root_dir(root_dir: str, tier_type: str, group_access: bool) -> str:
    """Raise ValueError unless *root_dir* and its parents are safe (see the
    module docstring) for the tier *tier_type*; create the missing part of
    the root. Returns the resolved root (os.path.realpath), the one path the
    tier must use from then on."""
    root = os.path.realpath(root_dir)
    paths = [root]  # the root and its parents, innermost first
    while os.path.dirname(paths[-1]) != paths[-1]:
        paths.append(os.path.dirname(paths[-1]))
    missing = [
        path
        for path in paths
        if not _check_dir(root_dir, tier_type, group_access, path, path == root)
    ]
    # Created outermost first with the tier's mode, each level checked as it
    # is made: a directory or link another user puts there meanwhile is
    # refused before anything is made in it.
    mode = _GROUP_DIR_MODE if group_access else _DIR_MODE
    for path in reversed(missing):
        try:
            os.mkdir(path, mode)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                os.fchmod(fd, mode)  # exact, whatever the umask
            finally:
                os.close(fd)
        except FileExistsError:
            pass  # made meanwhile: checked below
        except OSError as e:
            raise OSError(
                e.errno,
                f"root_dir {root_dir!r} of the '{tier_type}' tier cannot be "
                f"created: {path}: {e.strerror}. Fix: create it, or use a "
                "root_dir in a directory the engine's user can write",
            ) from None
        if not _check_dir(root_dir, tier_type, group_access, path, path == root):
            raise OSError(
                errno.ENOENT,
                f"root_dir {root_dir!r} of the '{tier_type}' tier: {path} was "
                "removed while the tier created it. Fix: start the engine again",
            )
    return root


MIN_KEY_BYTES = 32
MAX_KEY_BYTES = 4096

_KEY_FIX = (
    "create it with `head -c 32 /dev/urandom > {path} && chmod 600 {path}` "
    "and give every engine that shares root_dir the same file"
)


def _hkdf_sha256(secret: bytes, info: bytes) -> bytes:
    """HKDF-SHA256 (RFC 5869) with a fixed salt: one 32-byte output."""
    prk = hmac.digest(b"vllm fs tier key v1", secret, "sha256")
    return hmac.digest(prk, info + b"\x01", "sha256")


class TierKey:
    """The two keys derived from the tier's key file: file names and the
    blocks' MAC. Its repr never shows them."""

    __slots__ = ("_name_key", "mac_key")

    def __init__(self, secret: bytes) -> None:
        self._name_key = _hkdf_sha256(secret, b"file names")
        self.mac_key = _hkdf_sha256(secret, b"block MAC")

    def file_stem(self, block_hash: bytes) -> str:
        """The keyed name of a block hash's files: without the key, nobody
        can compute where a prefix's block lives or test whether it exists.
        Keyed BLAKE2b: about a third of HMAC-SHA256's cost on a 32-byte
        input (this runs on the scheduler's thread, once per lookup)."""
        return hashlib.blake2b(
            block_hash, key=self._name_key, digest_size=16
        ).hexdigest()

    def __repr__(self) -> str:
        return "TierKey(<redacted>)"


def _read_up_to(fd: int, limit: int) -> bytes:
    """Up to *limit* bytes of *fd*: one read may return fewer (NFS, FUSE)."""
    chunks = []
    while limit > 0:
        chunk = os.read(fd, limit)
        if not chunk:
            break
        chunks.append(chunk)
        limit -= len(chunk)
    return b"".join(chunks)


def load_key_file(key_file: object, tier_type: str, group_access: bool) -> TierKey:
    """Read and check the tier's key file; ValueError naming the path and
    the fix if it is missing, not a regular file, not private, empty, too
    short or too long. The message never holds the key's bytes."""
    if not isinstance(key_file, str) or not os.path.isabs(key_file):
        # not echoed: it may be the key itself, given inline by mistake
        raise ValueError(
            f"key_file of the '{tier_type}' tier must be the absolute path of "
            "a file holding the key (never the key itself, which ps and the "
            "logs would show)"
        )
    prefix = f"key_file {key_file!r} of the '{tier_type}' tier"
    fix = _KEY_FIX.format(path=key_file)
    try:
        # O_NONBLOCK: a FIFO (or device) at the path is refused below, not
        # waited on; it does not change reads of a regular file.
        fd = os.open(
            key_file,
            os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0),
        )
    except FileNotFoundError:
        raise ValueError(f"{prefix} does not exist: {fix}") from None
    except OSError as e:
        raise ValueError(f"{prefix} cannot be read ({e.strerror}): {fix}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{prefix} is not a regular file: {fix}")
        mode = stat.S_IMODE(st.st_mode)
        shared = group_access and st.st_gid in _engine_groups()
        allowed = 0o740 if shared else 0o700
        if mode & ~allowed & 0o077:
            who = "others" if mode & 0o007 else "its group"
            fix = f"chmod {'640' if shared else '600'} {key_file}"
            if group_access and not shared and who == "its group":
                who = (
                    f"its group {st.st_gid}, which the engine's user is not a member of"
                )
                fix = f"chgrp {os.getegid()} {key_file}, or chmod 600 {key_file}"
            raise ValueError(
                f"{prefix} is accessible by {who} (mode {mode:04o}): anyone "
                f"who reads it can plant blocks that load. Fix: {fix}"
            )
        if st.st_uid not in (os.geteuid(), 0):
            raise ValueError(
                f"{prefix} is owned by another user (uid "
                f"{_owner_name(st.st_uid)}): chown it to uid {os.geteuid()}"
            )
        secret = _read_up_to(fd, MAX_KEY_BYTES + 1)
    finally:
        os.close(fd)
    if not secret:
        raise ValueError(f"{prefix} is empty: {fix}")
    if len(secret) < MIN_KEY_BYTES:
        raise ValueError(
            f"{prefix} is too short ({len(secret)} bytes, at least "
            f"{MIN_KEY_BYTES} needed): {fix}"
        )
    if len(secret) > MAX_KEY_BYTES:
        raise ValueError(
            f"{prefix} is longer than {MAX_KEY_BYTES} bytes (is it the "
            f"right file?): {fix}"
        )
    return TierKey(secret)
