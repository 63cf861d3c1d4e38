import json
import struct
import subprocess
import sys
import zlib

import pytest
import torch
from store_testlib import make_entry

from ragkv.keys import KEY_PREFIX
from ragkv.store.entry import (
    CorruptEntry,
    EntryMeta,
    decode_header,
    decode_layer,
    encode,
    quantize_layer,
)


@pytest.mark.parametrize("model_dtype", ["float32", "float16", "bfloat16"])
def test_roundtrip_model_dtype_is_exact(model_dtype):
    meta, layers = make_entry(storage=model_dtype, model_dtype=model_dtype)
    enc = encode(meta, layers)
    m, lay = decode_header(enc.header, meta.key)
    assert m == meta
    for i, (k, v) in enumerate(layers):
        dk, dv = decode_layer(lay, i, enc.blobs[i]).dequantize(model_dtype)
        assert torch.equal(dk, k) and torch.equal(dv, v)


@pytest.mark.parametrize(
    "storage,axis,bound",
    [
        ("float16", None, 1e-3),
        ("bfloat16", None, 8e-3),
        ("int8", "token", 0.03),
        ("int8", "channel", 0.03),
        ("int8", "auto", 0.03),
    ],
)
def test_roundtrip_lossy_within_bounds(storage, axis, bound):
    meta, layers = make_entry(storage=storage, axis=axis, n_tokens=64, dim=32)
    enc = encode(meta, layers)
    _, lay = decode_header(enc.header, meta.key)
    for i, (k, v) in enumerate(layers):
        st = decode_layer(lay, i, enc.blobs[i])
        dk, dv = st.dequantize(torch.float32)
        for a, b in ((dk, k), (dv, v)):
            rel = ((a - b).norm() / b.norm()).item()
            assert rel < bound, (storage, axis, rel)
        if storage == "int8":
            assert st.k.dtype == torch.int8 and st.k_scale.dtype == torch.float32
            # absmax bound: error of each element <= scale / 2
            assert ((dk - k).abs() <= st.k_scale / 2 + 1e-6).all()


def test_scale_shapes_follow_axis():
    k = torch.randn(2, 5, 4)
    assert quantize_layer(k, k, "int8", "token").k_scale.shape == (2, 5, 1)
    assert quantize_layer(k, k, "int8", "channel").k_scale.shape == (2, 1, 4)
    st = quantize_layer(k, k, "int8", "auto")  # KIVI: K per channel, V per token
    assert st.k_scale.shape == (2, 1, 4) and st.v_scale.shape == (2, 5, 1)


def test_meta_validation_lists_valid_values():
    meta, _ = make_entry()
    with pytest.raises(ValueError, match="valid"):
        EntryMeta(**{**meta.__dict__, "storage_dtype": "int4"})


def _rehash(header: bytes, mutate) -> bytes:
    """Re-encode a header after editing its JSON (valid crc: only the semantic checks can catch it)."""
    magic, ver, _, _ = struct.unpack_from("<8sIII", header)
    doc = json.loads(header[20:])
    mutate(doc)
    js = json.dumps(doc).encode()
    return struct.pack("<8sIII", magic, ver, len(js), zlib.crc32(js)) + js


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["layers"][0]["tensors"]["k"].__setitem__("shape", [2, 8, 16]),
        lambda d: d["meta"].__setitem__("num_layers", "3"),
        lambda d: d["layers"][1].__setitem__("nbytes", 64),
        lambda d: d["layers"].pop(),
        lambda d: d.__setitem__("version", 99),
        lambda d: d["meta"].__setitem__("storage_dtype", "pickle"),
    ],
)
def test_header_semantic_corruption_raises(mutate):
    meta, layers = make_entry()
    enc = encode(meta, layers)
    with pytest.raises(CorruptEntry):
        decode_header(_rehash(enc.header, mutate), meta.key)


def test_header_bytes_corruption_raises():
    meta, layers = make_entry()
    h = bytearray(encode(meta, layers).header)
    for pos in (0, 9, 30, len(h) - 2):
        bad = bytearray(h)
        bad[pos] ^= 0x10
        with pytest.raises(CorruptEntry):
            decode_header(bytes(bad), meta.key)
    with pytest.raises(CorruptEntry):
        decode_header(bytes(h[:-5]), meta.key)
    with pytest.raises(CorruptEntry, match="bound to key"):
        decode_header(bytes(h), "ragkv1-" + "0" * 64)


def test_blob_corruption_and_nonfinite_raise():
    meta, layers = make_entry()
    enc = encode(meta, layers)
    _, lay = decode_header(enc.header, meta.key)
    b = bytearray(enc.blobs[1])
    b[17] ^= 1
    with pytest.raises(CorruptEntry, match="checksum"):
        decode_layer(lay, 1, b)
    with pytest.raises(CorruptEntry):
        decode_layer(lay, 1, bytes(enc.blobs[1])[:-64])
    # a NaN with a matching checksum (a writer bug, not bit rot) is still refused
    layers[0][0][0, 0, 0] = float("nan")
    enc2 = encode(meta, layers)
    _, lay2 = decode_header(enc2.header, meta.key)
    with pytest.raises(CorruptEntry, match="non-finite"):
        decode_layer(lay2, 0, enc2.blobs[0])


def test_keys_stable_across_hash_seeds():
    code = (
        "from ragkv.keys import chunk_key, ModelFingerprint as F;"
        "f=F('llama','w@1','float32',30,3,64,{'theta':1e5});"
        "print(chunk_key(f,[1,2,3,99999],'sink1/v1','tenant'))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("0", "12345", "random")
    }
    assert len(outs) == 1 and next(iter(outs)).startswith(KEY_PREFIX)


def test_no_pickle_in_store_sources():
    import pathlib

    import ragkv.store as pkg

    for p in pathlib.Path(pkg.__file__).parent.glob("*.py"):
        src = p.read_text()
        for bad in ("import pickle", "torch.load", "allow_pickle=True", "np.load("):
            assert bad not in src, (p, bad)
