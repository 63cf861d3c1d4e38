"""Value types of one entry: its metadata (``EntryMeta``), its byte layout as the header describes
it (``Layout``), its encoded bytes (``EncodedEntry``) and its decoded K/V (``ChunkKV``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torch import Tensor

from ragkv.store.quant import MODEL_DTYPES, QUANT_AXES, STORAGE_DTYPES

ALIGN = 64


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class EntryMeta:
    key: str
    token_ids: tuple[int, ...]
    start_pos: int  # prefilled at absolute positions [start_pos, start_pos + len(token_ids))
    num_layers: int
    num_kv_heads: int
    head_dim: int
    model_dtype: str  # dtype K/V decode to
    storage_dtype: str  # model dtype | float16 | bfloat16 | int8
    quant_axis: str | None  # int8 only: "token" | "channel" | "auto" (K channel, V token)
    fingerprint: str
    policy: str
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        if self.model_dtype not in MODEL_DTYPES:
            raise ValueError(f"model_dtype {self.model_dtype!r}: valid are {MODEL_DTYPES}")
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage_dtype {self.storage_dtype!r}: valid are {STORAGE_DTYPES}")
        if self.storage_dtype == "int8":
            if self.quant_axis not in QUANT_AXES:
                raise ValueError(f"quant_axis {self.quant_axis!r}: valid for int8 are {QUANT_AXES}")
        elif self.quant_axis is not None:
            raise ValueError("quant_axis is only meaningful for storage_dtype='int8'")
        if not self.token_ids:
            raise ValueError("EntryMeta: a chunk needs at least one token")
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"EntryMeta.{name} must be >= 1")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def axes(self) -> tuple[str | None, str | None]:
        """Scale axis of K and of V (None when not quantized)."""
        if self.storage_dtype != "int8":
            return None, None
        if self.quant_axis == "auto":
            return "channel", "token"
        return self.quant_axis, self.quant_axis

    def to_json(self) -> dict:
        d = asdict(self)
        d["token_ids"] = list(self.token_ids)
        return d


@dataclass
class ChunkKV:
    meta: EntryMeta
    layers: list[tuple[Tensor, Tensor]]  # decoded (K, V) per layer, [kv_heads, tokens, head_dim]


@dataclass
class EncodedEntry:
    header: bytes
    blobs: list  # list of bytes-like (bytes | bytearray | memoryview), one per layer

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(len(b) for b in self.blobs)


@dataclass(frozen=True)
class TensorLayout:
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class LayerLayout:
    offset: int  # from the start of the data section (disk: file offset = data_offset + offset)
    nbytes: int
    checksum: int
    tensors: dict[str, TensorLayout]


@dataclass(frozen=True)
class Layout:
    meta: EntryMeta
    header_nbytes: int
    layers: tuple[LayerLayout, ...]

    @property
    def data_offset(self) -> int:
        return align_up(self.header_nbytes)

    @property
    def data_nbytes(self) -> int:
        last = self.layers[-1]
        return last.offset + last.nbytes

    @property
    def total_nbytes(self) -> int:  # header + padding + all blobs (the disk file size)
        return self.data_offset + self.data_nbytes


def expected_shapes(meta: EntryMeta) -> dict[str, tuple[int, ...]]:
    h, n, d = meta.num_kv_heads, meta.num_tokens, meta.head_dim
    out: dict[str, tuple[int, ...]] = {"k": (h, n, d), "v": (h, n, d)}
    k_axis, v_axis = meta.axes()
    for name, axis in (("k_scale", k_axis), ("v_scale", v_axis)):
        if axis is not None:
            out[name] = (h, n, 1) if axis == "token" else (h, 1, d)
    return out


def expected_dtypes(meta: EntryMeta) -> dict[str, str]:
    out = {"k": meta.storage_dtype, "v": meta.storage_dtype}
    if meta.storage_dtype == "int8":
        out.update(k_scale="float32", v_scale="float32")
    return out
