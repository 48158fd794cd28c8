"""What refcoll may act on as root: the cluster folder, its state files, /etc/netns; who owns what.

``refcoll cluster down`` kills processes and deletes namespaces by what a state file
names, so a state file is trusted only as ssh trusts ``authorized_keys``: a regular
file (no link) in a real folder (no link), owned by root or this user and writable by
no one else, the folders above included (a sticky one such as ``/tmp`` will do); its
prefix one refcoll draws (``rc`` and six hex digits), named after it, and its
namespaces of the names a cluster of that prefix makes (:func:`ours`). It is read by
:mod:`refcoll.core.reading` (bounded, finite numbers). Anything else is one line saying
why (:class:`~refcoll.core.errors.UsageError`). A node's ``/etc/netns/NS`` folder is
written and removed only where it is a real folder inside ``/etc/netns``.

A cluster's owner (the process of ``with Cluster(...)``) runs while a process of its id
runs that started when it did (field 22 of ``/proc/PID/stat``): an id given again to
another process is no owner.

Example:
    >>> ours("rc1a2b3c", "rc1a2b3c-n2"), ours("rc1a2b3c", "rc1a2b3c-evil")
    (True, False)
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path

from ..core.errors import UsageError
from ..core.reading import loads_json, number, open_regular
from .spec import MAX_NODES

__all__ = ["PREFIX", "MAX_STATE_BYTES", "NETNS_ETC", "ours", "check_folder", "read_state",
           "scan", "start_time", "owned", "etc_folder", "remove_etc"]

#: Where ``ip netns exec`` finds a namespace's own ``/etc`` files (``hosts``).
NETNS_ETC = Path("/etc/netns")

#: The largest state file read back (64 nodes take some 20 KB).
MAX_STATE_BYTES = 1 << 20

#: A cluster's prefix, as :meth:`Cluster.up` draws it: ``rc`` and six lowercase hex digits.
PREFIX = re.compile(r"rc[0-9a-f]{6}")


def ours(prefix: str, ns) -> bool:
    """Whether ``ns`` is a namespace cluster ``prefix`` makes: ``PREFIX-hub`` or ``PREFIX-nN``."""
    if not (isinstance(ns, str) and PREFIX.fullmatch(prefix)):
        return False
    m = re.fullmatch(re.escape(prefix) + r"-(?:hub|n([1-9][0-9]{0,2}))", ns)
    return bool(m) and (m.group(1) is None or int(m.group(1)) <= MAX_NODES)


def _unsafe(path, info: os.stat_result, *, sticky: bool = False) -> str | None:
    """Why a file or folder is not one refcoll may act on, as root (None: it may).

    ``sticky``: a folder writable by all but sticky (``/tmp``) will do, as a folder above.
    """
    if info.st_uid not in (0, os.geteuid()):
        return f"is owned by user {info.st_uid}, not root"
    if info.st_mode & 0o022 and not (sticky and info.st_mode & stat.S_ISVTX):
        return (f"is writable by others (mode {stat.S_IMODE(info.st_mode):o}; chmod go-w "
                f"{path})")
    return None


def check_folder(folder: Path, *, create: bool = False) -> Path | None:
    """Return the state folder, checked (None: it does not exist and ``create`` is False).

    It must be an absolute path to a real folder (no link), owned by root or this user
    and writable by no one else; the folders above it too, but for a sticky one such as
    ``/tmp``, both along the path as given and where it resolves. A link on the way must
    be root's or this user's (another user's link in a shared folder would choose where
    root writes). ``create`` makes the missing folders (mode 0755) only after that.

    Raises:
        UsageError: it, or a folder or link above, is not one refcoll may act on.
    """
    folder = Path(folder)
    where = f"{folder}: the cluster folder (REFCOLL_CLUSTER_DIR)"
    if not folder.is_absolute():
        raise UsageError(f"{where} is not an absolute path; refcoll keeps cluster state in one "
                         "folder whatever the current one (default /run/refcoll/clusters)")
    why = _unsafe_path(folder)
    if why:
        raise UsageError(f"{where} {why}; refcoll acts on no cluster state there")
    if create:
        missing = [p for p in [folder, *folder.parents] if not os.path.lexists(p)]
        for part in reversed(missing):
            try:
                os.mkdir(part, 0o755)
                os.chmod(part, 0o755)  # whatever the umask
            except FileExistsError:
                pass
            except OSError as exc:
                raise UsageError(f"{where} cannot be made ({exc.strerror})") from None
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        raise UsageError(f"{where} is a symbolic link; refcoll keeps cluster state only in a "
                         "real folder")
    if not stat.S_ISDIR(info.st_mode):
        raise UsageError(f"{where} is not a folder")
    why = _unsafe(folder, info) or _unsafe_path(folder)
    if why:
        raise UsageError(f"{where} {why}; refcoll acts on no cluster state there")
    return folder


def _unsafe_path(folder: Path) -> str | None:
    """Why a folder above ``folder`` (as given, and as it resolves) or a link on the way is
    not one refcoll may act through (None: every one may be)."""
    for part in reversed(folder.parents):  # from / down, as given
        try:
            info = os.lstat(part)
        except FileNotFoundError:
            break  # the rest is made here, by root
        if stat.S_ISLNK(info.st_mode):
            if info.st_uid not in (0, os.geteuid()):
                return f"passes through {part}, a link of user {info.st_uid}"
            continue
        above = _unsafe(part, info, sticky=True)
        if above:
            return f"is in {part}, which {above}"
    for parent in Path(os.path.realpath(folder)).parents:
        if os.path.lexists(parent):
            above = _unsafe(parent, os.stat(parent), sticky=True)
            if above:
                return f"is in {parent}, which {above}"
    return None


def read_state(path: Path, check=None) -> dict:
    """Return the state in ``path`` if refcoll can trust it; else one line saying why.

    Trusted: a regular file (not a link), owned by root or this user, writable by no
    one else, of at most :data:`MAX_STATE_BYTES`, read by :mod:`refcoll.core.reading`;
    named after its prefix (``rc1a2b3c.json``), its namespaces the cluster's own, and,
    where it has a spec, ``check(state, where)`` raising nothing (the emulator's: its
    nodes are what its spec makes). A state with no spec lists no node: it can be
    removed, not run on.
    """
    where = f"{path}: cluster state file"
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise UsageError(f"{where} is a symbolic link, not a file refcoll wrote")
    why = _unsafe(path, info)
    if why:
        raise UsageError(f"{where} {why}")
    with open_regular(path, max_bytes=MAX_STATE_BYTES, what="cluster state file") as fh:
        opened = os.fstat(fh.fileno())
        if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
            raise UsageError(f"{where} changed while it was read; run the command again")
        data = fh.read(MAX_STATE_BYTES + 1)
    if len(data) > MAX_STATE_BYTES:
        raise UsageError(f"{where} holds more than {MAX_STATE_BYTES} bytes")
    state = loads_json(data, source=str(path))
    _check_state(state, path, where)
    if "spec" in state and check is not None:
        check(state, where)
    return state


def _check_state(state, path: Path, where: str) -> None:
    """Refuse a state that is not one :meth:`Cluster._write_state` writes."""
    if not isinstance(state, dict):
        raise UsageError(f"{where} holds no cluster state (a JSON object)")
    prefix = state.get("prefix")
    if not isinstance(prefix, str) or not PREFIX.fullmatch(prefix):
        raise UsageError(f"{where}: prefix {prefix!r:.40} is not one refcoll makes (rc and 6 "
                         "lowercase hex digits)")
    if path.name != f"{prefix}.json":
        raise UsageError(f"{where}: names cluster {prefix}, but refcoll keeps that one in "
                         f"{prefix}.json")
    made = state.get("namespaces")
    if not isinstance(made, list) or len(made) > MAX_NODES + 1:
        raise UsageError(f"{where}: namespaces must be a list of at most {MAX_NODES + 1} names")
    for ns in made:
        if not ours(prefix, ns):
            raise UsageError(f"{where}: namespace {ns!r:.60} is not one cluster {prefix} makes "
                             f"({prefix}-hub, {prefix}-n1, ...)")
    owner = state.get("owner")
    if owner is not None:
        number(owner, where=f"{where}: owner", integer=True, least=1, most=1 << 22)
    start = state.get("owner_start")
    if start is not None:
        number(start, where=f"{where}: owner_start", integer=True, least=0)
    if not isinstance(state.get("detached", False), bool):
        raise UsageError(f"{where}: detached must be true or false")
    if "spec" not in state and state.get("nodes", []) != []:
        raise UsageError(f"{where}: lists nodes but no spec that makes them")


def scan(folder: Path, check=None) -> tuple[list[dict], list[str]]:
    """Return the trusted states in ``folder`` and, for each other state file, why not.

    Raises:
        UsageError: the folder itself is not one refcoll may act on (:func:`check_folder`).
    """
    folder = check_folder(folder)
    good, bad = [], []
    for path in sorted(folder.glob("*.json")) if folder else []:
        if path.name.endswith(".topo.json"):
            continue  # a cluster's topology, beside its state: read by none of these
        try:
            good.append(read_state(path, check))
        except UsageError as exc:
            bad.append(str(exc))
        except FileNotFoundError:
            continue  # removed since the folder was listed: its cluster is gone
        except OSError as exc:
            bad.append(f"{path}: cluster state file cannot be read ({exc.strerror})")
    return good, bad


def start_time(pid) -> int | None:
    """Return process ``pid``'s start time (field 22 of ``/proc/PID/stat``); None: no process."""
    try:
        text = Path(f"/proc/{int(pid)}/stat").read_text()
        return int(text.rsplit(")", 1)[1].split()[19])  # fields 3.. follow the command's ")"
    except (OSError, ValueError, IndexError):
        return None


def owned(state: dict) -> bool:
    """Whether the process that holds the cluster (``with Cluster``) still runs.

    A process of the owner's id that started at another time is another process
    that was given the id again: the owner is gone.
    """
    if state.get("detached") or not state.get("owner"):
        return False
    started = start_time(state["owner"])
    if started is None:
        return False
    return state.get("owner_start") is None or started == state["owner_start"]


def _inside_etc(folder: Path) -> bool:
    """Whether ``folder`` is a real folder (no link) directly inside :data:`NETNS_ETC`."""
    try:
        info = os.lstat(folder)
    except OSError:
        return False
    return (stat.S_ISDIR(info.st_mode)
            and os.path.realpath(folder.parent) == os.path.realpath(NETNS_ETC)
            and os.path.realpath(folder) == os.path.join(os.path.realpath(NETNS_ETC),
                                                          folder.name))


def etc_folder(ns: str) -> Path:
    """Make ``/etc/netns/NS`` (``ip netns exec``'s ``/etc`` for the namespace) and return it."""
    NETNS_ETC.mkdir(mode=0o755, parents=True, exist_ok=True)
    folder = NETNS_ETC / ns
    try:
        os.mkdir(folder, 0o755)
    except FileExistsError:
        pass
    if not _inside_etc(folder):
        raise UsageError(f"{folder}: is not a folder inside {NETNS_ETC} (a link, or a file); "
                         "refcoll writes a node's hosts file only there: remove it")
    return folder


def remove_etc(ns: str) -> None:
    """Remove ``/etc/netns/NS``: only a real folder that resolves inside ``/etc/netns``."""
    folder = NETNS_ETC / ns
    if _inside_etc(folder):
        shutil.rmtree(folder, ignore_errors=True)  # links inside are removed, not followed
