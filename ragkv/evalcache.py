"""``ragkv eval``'s on-disk results: full prefill's reference and every method's outcome, per question.

An evaluation over hundreds of questions takes hours on a CPU, and most of it is the same work run
after run: full prefill's answer to a question does not change when a new selector is tried. So each
question's results are records in a folder (default ``$RAGKV_HOME/eval-cache``), one JSON file each,
written the moment they are computed (to a temporary name, then renamed: a killed run leaves no
half-written record, and resumes where it stopped):

    ref/<key>.json      full prefill: its greedy answer (token ids and text), its TTFT samples, the
                        top of its first-token distribution (for KL) and of its teacher-forced logits
                        along its answer (for the divergence margin)
    method/<key>.json   one method on one question: TTFT, fidelity, the greedy answer, the time split

A reference's key digests everything its values depend on: the model's fingerprint and dtype, the
prompt's token ids (the template, the question format, the question and the contexts), the token
budgets, the timed repeats, ragkv's eval format version, and this machine (``machine_id``: TTFT is a
property of the CPU, and so, by a few ulps, is every logit). A method's key adds its selector with
all its settings, the ratio, the precompute policy, the storage format, the store and the blend's
loading mode. ragkv's own code is not in a key beyond its version: after changing the read path,
run with ``fresh`` (``ragkv eval --fresh``) to compute the methods again. A record that cannot be read
(a disk fault) counts as missing and is computed again; gold answers are never in a record (EM/F1
are scored when the report is made), so fixing a gold answer needs no rerun.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import warnings
from pathlib import Path

EVAL_FORMAT = 1  # bump when a record's fields or meaning change
KINDS = ("ref", "method")
_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "neon", "sve")


def digest(obj) -> str:
    """A stable hex digest of a JSON-able object (canonical JSON, blake2b-128)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def machine_id() -> str:
    """This machine as TTFT and the kernels' rounding see it: CPU vendor, family, model and name, the
    vector extensions the kernels pick from, and torch's thread count."""
    import torch

    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("vendor_id", "cpu family", "model", "model name", "flags") and key not in info:
                    info[key] = value.strip()
    except OSError:
        pass
    flags = set(info.pop("flags", "").split())
    parts = [info.get(k, "") for k in ("vendor_id", "cpu family", "model", "model name")] or [platform.processor()]
    parts.append("+".join(f for f in _FLAGS if f in flags))
    parts.append(f"{torch.get_num_threads()} threads")
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name())
    return " | ".join(parts)


class EvalCache:
    """Records by kind and key, in ``root`` (created on first write); ``root=None``: in memory only
    (nothing survives the process). ``fresh``: ignore what is stored (new records still overwrite)."""

    def __init__(self, root: str | os.PathLike | None, fresh: bool = False):
        self.root = None if root is None else Path(root)
        self.fresh = fresh
        self._memory: dict[tuple[str, str], dict] = {}
        self.hits = self.writes = 0
        if self.root is not None and self.root.exists() and not self.root.is_dir():
            raise ValueError(f"eval cache {self.root} is not a directory")

    def _path(self, kind: str, key: str) -> Path:
        if kind not in KINDS:
            raise ValueError(f"unknown record kind {kind!r}; valid: {', '.join(KINDS)}")
        return self.root / kind / f"{key}.json"

    def get(self, kind: str, key: str) -> dict | None:
        if self.fresh:
            return None
        if self.root is None:
            rec = self._memory.get((kind, key))
        else:
            path = self._path(kind, key)
            try:
                rec = json.loads(path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                return None
            except (OSError, ValueError) as e:  # a damaged record is computed again, never trusted
                warnings.warn(f"eval cache: {path} unreadable ({e}); computing it again", stacklevel=2)
                return None
            if not isinstance(rec, dict) or rec.get("format") != EVAL_FORMAT or rec.get("key") != key:
                return None
        if rec is not None:
            self.hits += 1
        return rec

    def put(self, kind: str, key: str, record: dict) -> dict:
        record = {**record, "format": EVAL_FORMAT, "key": key}
        self.writes += 1
        if self.root is None:
            self._memory[(kind, key)] = record
            return record
        path = self._path(kind, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f, separators=(",", ":"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return record
