"""The entry codec (on the wire and on disk). No pickle anywhere: raw little-endian tensor bytes
plus a JSON header. Value types live in ``layout.py``, storage dtypes and int8 in ``quant.py``.

Header bytes (``EncodedEntry.header``)::

    MAGIC (8) | u32 format version | u32 json length | u32 crc32(json) | json (utf-8)

The JSON holds ``meta`` (EntryMeta, key included: the key->header binding), the checksum algorithm
and, per layer, the blob's byte length, its checksum and each tensor's (dtype, shape, offset, nbytes)
inside the blob. A layer blob is k | v | k_scale | v_scale, each tensor 64-byte aligned, the blob
padded to a multiple of 64 bytes. Layers are independent blobs: a backend can fetch one layer
without touching the others (the disk file is ``header | pad to 64 | blob 0 | blob 1 | ...``).

Checksum ("bsum64-crc32"): the blob viewed as little-endian uint64 words is summed (mod 2**64) per
4 KiB block with numpy, and crc32 is taken over the block sums. One pass at ~25 GB/s on one core,
vs zlib.crc32 ~5 GB/s and blake2b ~1 GB/s (measured, see README). It detects every single-bit flip,
any corruption confined to one 8-byte word, truncation and block reordering; it is a corruption
check, not a MAC. Decoding validates everything and raises ``CorruptEntry`` on any mismatch, and
``UnsupportedEntry`` for a valid magic with another format version (or an unknown checksum
algorithm): an entry of a newer writer, not a damaged one. A version field that differs while the
rest of the header is an intact header of this version is damage (``CorruptEntry``).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import numbers
import struct
import warnings
import zlib
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ragkv.store.errors import CorruptEntry, UnsupportedEntry
from ragkv.store.layout import (
    ALIGN,
    ChunkKV,
    EncodedEntry,
    EntryMeta,
    LayerLayout,
    Layout,
    TensorLayout,
    align_up,
    expected_dtypes,
    expected_shapes,
)
from ragkv.store.quant import ITEMSIZE, TORCH_DTYPE, StoredLayer, quantize_layer

# re-exported: callers import the entry's types from here
__all__ = [
    "ChunkKV", "CorruptEntry", "EncodedEntry", "EntryMeta", "LayerLayout", "Layout", "StoredLayer",
    "TensorLayout", "UnsupportedEntry", "check_layer_index", "checksum", "decode_header", "decode_layer", "encode", "encode_stored",
    "header_nbytes", "quantize_layer",
]

MAGIC = b"RAGKVE\x00\x01"
FORMAT_VERSION = 1
CHECKSUM_ALGO = "bsum64-crc32"
_PREFIX = struct.Struct("<8sIII")  # magic, version, json length, crc32(json)
MAX_HEADER_JSON = 64 << 20

_TENSOR_NAMES = ("k", "v", "k_scale", "v_scale")

# ---------------------------------------------------------------------------------------------
# pure helpers
# ---------------------------------------------------------------------------------------------


def checksum(buf) -> int:
    """bsum64-crc32 of a bytes-like whose length is a multiple of 8 (blobs are padded to 64)."""
    words = np.frombuffer(buf, dtype="<u8")
    full = len(words) // 512 * 512
    sums = words[:full].reshape(-1, 512).sum(axis=1, dtype=np.uint64)
    tail = words[full:].sum(dtype=np.uint64)
    crc = zlib.crc32(sums.tobytes())
    crc = zlib.crc32(np.asarray([tail, len(words)], dtype="<u8").tobytes(), crc)
    return crc


def _tensor_bytes(t: Tensor) -> memoryview:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


# ---------------------------------------------------------------------------------------------
# encode
# ---------------------------------------------------------------------------------------------


def encode_stored(meta: EntryMeta, layers: list[StoredLayer]) -> EncodedEntry:
    """Serialize already-quantized layers (one copy of the tensor bytes)."""
    if len(layers) != meta.num_layers:
        raise ValueError(f"encode: {len(layers)} layers, meta says {meta.num_layers}")
    shapes, dtypes = expected_shapes(meta), expected_dtypes(meta)
    blobs, lay_json, offset = [], [], 0
    for i, layer in enumerate(layers):
        tensors = layer._tensors()
        if set(tensors) != set(shapes):
            raise ValueError(f"encode: layer {i} has tensors {sorted(tensors)}, expected {sorted(shapes)}")
        pos, parts, tl = 0, [], {}
        for name in _TENSOR_NAMES:
            if name not in tensors:
                continue
            t = tensors[name]
            if tuple(t.shape) != shapes[name] or t.dtype != TORCH_DTYPE[dtypes[name]]:
                raise ValueError(
                    f"encode: layer {i} {name} is {tuple(t.shape)} {t.dtype}, "
                    f"expected {shapes[name]} {dtypes[name]}"
                )
            mv = _tensor_bytes(t)
            parts.append((pos, mv))
            tl[name] = {"dtype": dtypes[name], "shape": list(shapes[name]), "offset": pos, "nbytes": len(mv)}
            pos = align_up(pos + len(mv))
        blob = bytearray(pos)
        for p, mv in parts:
            blob[p : p + len(mv)] = mv
        blobs.append(blob)
        lay_json.append({"offset": offset, "nbytes": pos, "checksum": checksum(blob), "tensors": tl})
        offset += pos
    doc = {
        "format": "ragkv-entry",
        "version": FORMAT_VERSION,
        "checksum": CHECKSUM_ALGO,
        "meta": meta.to_json(),
        "layers": lay_json,
    }
    js = json.dumps(doc, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
    header = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(js), zlib.crc32(js)) + js
    return EncodedEntry(header, blobs)


def encode(meta: EntryMeta, layers_kv: list[tuple[Tensor, Tensor]]) -> EncodedEntry:
    """Quantize each (k, v) per meta.storage_dtype / quant_axis and serialize."""
    if len(layers_kv) != meta.num_layers:
        raise ValueError(f"encode: {len(layers_kv)} layers, meta says {meta.num_layers}")
    stored = [quantize_layer(k, v, meta.storage_dtype, meta.quant_axis) for k, v in layers_kv]
    return encode_stored(meta, stored)


# ---------------------------------------------------------------------------------------------
# decode (validates everything; any failure -> CorruptEntry)
# ---------------------------------------------------------------------------------------------


def _req(d: Any, name: str, typ, where: str):
    if not isinstance(d, dict) or name not in d:
        raise CorruptEntry(f"{where}: missing {name!r}")
    val = d[name]
    if typ is int and (not isinstance(val, int) or isinstance(val, bool)):
        raise CorruptEntry(f"{where}.{name}: expected int, got {type(val).__name__}")
    if typ is not int and not isinstance(val, typ):
        raise CorruptEntry(f"{where}.{name}: expected {typ}, got {type(val).__name__}")
    return val


def header_nbytes(prefix: bytes) -> int:
    """Total header length from its first 20 bytes (for backends that read the header first)."""
    if len(prefix) < _PREFIX.size:
        raise CorruptEntry("header: truncated prefix")
    magic, version, n, crc = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise CorruptEntry("header: bad magic")
    if version != FORMAT_VERSION:
        if _is_our_json(prefix, n, crc):  # a damaged version field of an entry in our format
            raise CorruptEntry(f"header: format version {version}, but the header's JSON says {FORMAT_VERSION}")
        raise UnsupportedEntry(f"header: format version {version}, this build reads {FORMAT_VERSION}")
    if n > MAX_HEADER_JSON:
        raise CorruptEntry(f"header: json length {n} too large")
    return _PREFIX.size + n


def _is_our_json(header: bytes, n: int, crc: int) -> bool:
    """True when the bytes after the prefix are an intact JSON header of this build's version."""
    js = bytes(header[_PREFIX.size : _PREFIX.size + n])
    if n > MAX_HEADER_JSON or len(js) != n or zlib.crc32(js) != crc:
        return False
    try:
        doc = json.loads(js)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(doc, dict) and doc.get("format") == "ragkv-entry" and doc.get("version") == FORMAT_VERSION


def _meta_from_json(m: Any) -> EntryMeta:
    w = "meta"
    tok = _req(m, "token_ids", list, w)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tok):
        raise CorruptEntry("meta.token_ids: expected non-negative ints")
    qa = m.get("quant_axis") if isinstance(m, dict) else None
    if qa is not None and not isinstance(qa, str):
        raise CorruptEntry("meta.quant_axis: expected str or null")
    try:
        return EntryMeta(
            key=_req(m, "key", str, w),
            token_ids=tuple(tok),
            start_pos=_req(m, "start_pos", int, w),
            num_layers=_req(m, "num_layers", int, w),
            num_kv_heads=_req(m, "num_kv_heads", int, w),
            head_dim=_req(m, "head_dim", int, w),
            model_dtype=_req(m, "model_dtype", str, w),
            storage_dtype=_req(m, "storage_dtype", str, w),
            quant_axis=qa,
            fingerprint=_req(m, "fingerprint", str, w),
            policy=_req(m, "policy", str, w),
            extra=_req(m, "extra", dict, w),
        )
    except ValueError as e:
        raise CorruptEntry(f"meta: {e}") from None


def decode_header(header: bytes, expected_key: str | None = None) -> tuple[EntryMeta, Layout]:
    """Parse and validate a header. ``expected_key``: the key the entry was fetched under; a header
    bound to another key is corrupt (an entry stored under the wrong key is never served).

    Layer-streamed reads fetch the same header once per layer: parsed headers are memoized on their
    exact bytes (meta and layout are frozen), so only the first read of an entry pays for the JSON."""
    n = header_nbytes(header)
    meta, layout = _decode_header_bytes(bytes(header[:n]) if len(header) >= n else bytes(header))
    if expected_key is not None and meta.key != expected_key:
        raise CorruptEntry(f"header: bound to key {meta.key!r}, fetched as {expected_key!r}")
    return meta, layout


@functools.lru_cache(maxsize=4096)
def _decode_header_bytes(header: bytes) -> tuple[EntryMeta, Layout]:
    n = header_nbytes(header)
    if len(header) < n:
        raise CorruptEntry(f"header: truncated ({len(header)} of {n} bytes)")
    _, _, _jlen, crc = _PREFIX.unpack_from(header)
    js = bytes(header[_PREFIX.size : n])
    if zlib.crc32(js) != crc:
        raise CorruptEntry("header: checksum mismatch")
    try:
        doc = json.loads(js)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptEntry(f"header: bad json ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != "ragkv-entry":
        raise CorruptEntry("header: not a ragkv entry")
    if doc.get("version") != FORMAT_VERSION:  # the prefix said ours: inconsistent, not newer
        raise CorruptEntry(f"header: JSON version {doc.get('version')!r}, prefix says {FORMAT_VERSION}")
    if doc.get("checksum") != CHECKSUM_ALGO:
        raise UnsupportedEntry(f"header: checksum algorithm {doc.get('checksum')!r}, this build reads {CHECKSUM_ALGO}")
    meta = _meta_from_json(doc.get("meta"))
    lays = _req(doc, "layers", list, "header")
    if len(lays) != meta.num_layers:
        raise CorruptEntry(f"header: {len(lays)} layer layouts, meta says {meta.num_layers}")
    shapes, dtypes = expected_shapes(meta), expected_dtypes(meta)
    layers, offset = [], 0
    for i, lj in enumerate(lays):
        w = f"layers[{i}]"
        lo, ln = _req(lj, "offset", int, w), _req(lj, "nbytes", int, w)
        ck = _req(lj, "checksum", int, w)
        tj = _req(lj, "tensors", dict, w)
        if lo != offset or ln <= 0 or ln % ALIGN:
            raise CorruptEntry(f"{w}: bad offset/nbytes ({lo}, {ln})")
        if set(tj) != set(shapes):
            raise CorruptEntry(f"{w}: tensors {sorted(tj)}, expected {sorted(shapes)}")
        tensors = {}
        for name, t in tj.items():
            tw = f"{w}.{name}"
            dt, sh = _req(t, "dtype", str, tw), _req(t, "shape", list, tw)
            to, tn = _req(t, "offset", int, tw), _req(t, "nbytes", int, tw)
            if dt != dtypes[name] or tuple(sh) != shapes[name]:
                raise CorruptEntry(f"{tw}: {dt} {sh}, expected {dtypes[name]} {list(shapes[name])}")
            if tn != math.prod(sh) * ITEMSIZE[dt] or to < 0 or to % ALIGN or to + tn > ln:
                raise CorruptEntry(f"{tw}: bad byte range ({to}, {tn}) in a {ln}-byte blob")
            tensors[name] = TensorLayout(dt, tuple(sh), to, tn)
        ranges = sorted((t.offset, t.offset + t.nbytes) for t in tensors.values())
        if any(a[1] > b[0] for a, b in itertools.pairwise(ranges)):
            raise CorruptEntry(f"{w}: overlapping tensors")
        layers.append(LayerLayout(lo, ln, ck & 0xFFFFFFFF, tensors))
        offset += ln
    return meta, Layout(meta, n, tuple(layers))


_EXP_MASK = {"float16": 0x7C00, "bfloat16": 0x7F80}


def _all_finite(buf, dtype: str) -> bool:
    """Finiteness of a float buffer, in numpy (torch's intra-op threads cost more than the work
    for sub-MB tensors on small machines). fp32: a sum is finite only if every term is, overflow
    falls back to the exact check; fp16/bf16: no element has an all-ones exponent."""
    if dtype == "float32":
        a = np.frombuffer(buf, dtype="<f4")
        with np.errstate(all="ignore"):
            return bool(np.isfinite(a.sum())) or bool(np.isfinite(a).all())
    mask = _EXP_MASK[dtype]
    u = np.frombuffer(buf, dtype="<u2")
    return not bool(((u & mask) == mask).any())


def _frombuffer(blob, count: int, offset: int) -> Tensor:
    if isinstance(blob, bytes) or (isinstance(blob, memoryview) and blob.readonly):
        # an immutable buffer (e.g. a redis-py reply) that nothing else references once the read
        # returns: viewing it avoids a copy; torch warns because it cannot be written through
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(blob, dtype=torch.uint8, count=count, offset=offset)
    return torch.frombuffer(blob, dtype=torch.uint8, count=count, offset=offset)


def check_layer_index(i, layout: Layout | None = None) -> int:
    """A caller's layer index: an int (not a bool), and with ``layout`` within the entry's layers.
    A bad index is the caller's error (IndexError), never evidence against the entry."""
    if isinstance(i, bool) or not isinstance(i, numbers.Integral):
        raise IndexError(f"layer index must be an int, got {i!r}")
    if layout is not None and not 0 <= i < len(layout.layers):
        raise IndexError(
            f"layer index {i} out of range: entry {layout.meta.key} has {len(layout.layers)} layers"
        )
    return int(i)


def decode_layer(layout: Layout, i: int, blob, verify: bool = True) -> StoredLayer:
    """View one layer blob as tensors (no copy; the tensors share ``blob``'s memory). ``verify``
    checks the checksum and finiteness; lengths, dtypes and shapes are always checked. IndexError
    for an index outside the entry; CorruptEntry for bad bytes."""
    i = check_layer_index(i, layout)
    ll = layout.layers[i]
    if len(blob) != ll.nbytes:
        raise CorruptEntry(f"layer {i}: {len(blob)} bytes, header says {ll.nbytes}")
    if verify and checksum(blob) != ll.checksum:
        raise CorruptEntry(f"layer {i}: checksum mismatch")
    out = {}
    for name, t in ll.tensors.items():
        out[name] = _frombuffer(blob, t.nbytes, t.offset).view(TORCH_DTYPE[t.dtype]).view(t.shape)
    if verify:
        meta_dtype = layout.meta.storage_dtype
        if "k_scale" in out:  # int8: the scales are the only floats
            for name in ("k_scale", "v_scale"):
                sc = ll.tensors[name]
                a = np.frombuffer(blob, dtype="<f4", count=sc.nbytes // 4, offset=sc.offset)
                if not (np.isfinite(a).all() and (a >= 0).all()):
                    raise CorruptEntry(f"layer {i}: {name} has non-finite or negative scales")
        else:  # one pass over the whole blob (tensors are aligned; padding is zero bytes)
            if not _all_finite(blob, meta_dtype):
                raise CorruptEntry(f"layer {i}: non-finite values")
    return StoredLayer(out["k"], out["v"], out.get("k_scale"), out.get("v_scale"))

