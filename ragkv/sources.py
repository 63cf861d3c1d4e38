"""Documents for the precompute job: files (.txt/.md), JSON lines (.jsonl, field "text"), folders
(recursive, hidden entries skipped), and texts given directly. Nothing unusable is fatal: every file,
folder or line that cannot be used is reported with its reason.

Only regular files are read: a FIFO, device or socket (whatever its name) is reported and skipped,
never opened for long (a FIFO would block the job forever). A symbolic link to a file is read; a
symbolic link to a folder met inside a folder is reported and not followed (a folder given as a
path is read even when it is a link)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)


@dataclass
class Report:
    files_skipped: list[dict] = field(default_factory=list)  # {"path", "reason"}
    bad_lines: list[dict] = field(default_factory=list)  # {"path", "line", "reason"} of .jsonl files

    def skip(self, path, reason: str) -> None:
        self.files_skipped.append({"path": str(path), "reason": reason})


def decode_file(raw: bytes) -> tuple[str | None, str | None]:
    """(text, None) or (None, reason)."""
    if not raw.strip():
        return None, "empty"
    if b"\x00" in raw[:8192]:
        return None, "binary (NUL bytes)"
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})"
    if not text.strip():
        return None, "empty"
    return text, None


def lone_surrogate(text: str) -> str | None:
    """Why ``text`` is not valid Unicode (JSON may carry a lone surrogate, ``"\\ud800"``, which no
    tokenizer takes), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"a lone surrogate (\\u{ord(text[e.start]):04x}) at character {e.start}, not valid Unicode"
    return None


def _walk(path: Path, report: Report) -> Iterable[Path]:
    if not path.is_dir():
        yield path
        return

    def unreadable(err: OSError) -> None:
        report.skip(err.filename or path, f"unreadable directory: {err.strerror or err}")

    for root, dirs, files in os.walk(path, onerror=unreadable):
        dirs.sort()
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for d in dirs:
            if os.path.islink(os.path.join(root, d)):  # (os.walk lists them and does not enter them)
                report.skip(Path(root) / d, "symbolic link to a folder: not followed (give the folder itself "
                                            "as a path to read it)")
        for name in sorted(files):
            if not name.startswith("."):
                yield Path(root) / name


def _jsonl(p: Path, text: str, report: Report) -> list[tuple[str, str]]:
    docs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            report.bad_lines.append({"path": str(p), "line": lineno, "reason": f"invalid JSON: {e.msg}"})
            continue
        t = obj.get("text") if isinstance(obj, dict) else None
        if not isinstance(t, str) or not t.strip():
            report.bad_lines.append({"path": str(p), "line": lineno, "reason": 'no non-empty string field "text"'})
            continue
        why = lone_surrogate(t)
        if why:
            report.bad_lines.append({"path": str(p), "line": lineno, "reason": f'"text" holds {why}'})
            continue
        docs.append((f"{p}:{lineno}", t))
    if not docs:
        report.skip(p, "no usable .jsonl line")
    return docs


def read_documents(paths: Iterable[str | os.PathLike] = (), texts: Iterable[str] = (),
                   report: Report | None = None) -> list[tuple[str, str]]:
    """(doc id, text) of every path (file or folder) and every text. Unusable files and folders go to
    ``report.files_skipped``, bad .jsonl lines to ``report.bad_lines``."""
    report = report if report is not None else Report()
    if isinstance(paths, (str, os.PathLike)) or isinstance(texts, str):
        raise TypeError("paths and texts are lists (e.g. paths=['docs/'] or texts=['a document'])")
    docs: list[tuple[str, str]] = []
    for n, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"texts[{n}] is a {type(t).__name__}, expected str")
        if t.strip():
            docs.append((f"<text {n}>", t))
        else:
            report.skip(f"<text {n}>", "empty")
    for src in paths:
        root = Path(src)
        if not root.exists():
            report.skip(root, "no such file or directory")
            continue
        for p in _walk(root, report):
            suffix = p.suffix.lower()
            if suffix not in TEXT_SUFFIXES + JSONL_SUFFIXES:
                report.skip(p, f"unsupported type {suffix or '(none)'}")
                continue
            try:
                raw = _read_regular(p)
            except _NotRegular as e:
                report.skip(p, f"not a regular file ({e}): skipped")
                continue
            except OSError as e:
                report.skip(p, f"unreadable: {e.strerror or e}")
                continue
            text, why = decode_file(raw)
            if text is None:
                report.skip(p, why)
            elif suffix in TEXT_SUFFIXES:
                docs.append((str(p), text))
            else:
                docs.extend(_jsonl(p, text, report))
    return docs


class _NotRegular(Exception):
    pass


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a file"


def _read_regular(p: Path) -> bytes:
    """The bytes of ``p`` (a link is followed) if it is a regular file, else _NotRegular naming what it
    is. Checked before opening, and opened without blocking then checked again (a FIFO swapped in
    between is not waited on)."""
    mode = os.stat(p).st_mode
    if not stat.S_ISREG(mode):
        raise _NotRegular(_kind(mode))
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _NotRegular(_kind(mode))
        return f.read()
