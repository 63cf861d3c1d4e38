"""``EngineSpec``: a model, its precompute policy, storage and namespace as names and options (never
objects), so that a worker (a Ray actor, a CLI command) builds the same write path or read path as
the driver: a model is loaded where it runs."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ragkv.policy import PrecomputePolicy, StorageFormat


@dataclass(frozen=True)
class EngineSpec:
    """Everything a worker needs to build the same BlendEngine as the driver: names and options,
    never objects (a model is loaded where it runs). ``store_uri`` may hold a password: it is passed
    to the actors and never shown (``redact_uri``)."""

    model: str = "smollm2-135m"
    model_dtype: str = "auto"
    store_uri: str = ""
    sink: str = "template"
    gap: int | None = None
    context: int = PrecomputePolicy.context
    lead: bool = PrecomputePolicy.lead
    namespace: str = ""
    storage: StorageFormat | None = None  # None: entries in the model's dtype

    def resolved(self) -> EngineSpec:
        """'auto' replaced by this machine's choice, so machines of different kinds agree (the
        dtype is part of every key)."""
        from ragkv import models

        return replace(self, model_dtype=str(models.parse_dtype(self.model_dtype)).removeprefix("torch."))

    def policy(self) -> PrecomputePolicy:
        return PrecomputePolicy(self.sink, self.gap, self.context, self.lead)

    def prefiller(self, store=None):
        """The write path's Prefiller (``store``: an open store, else one opened from ``store_uri``)."""
        from ragkv.prefill import Prefiller

        return Prefiller(*self._load(), self._store(store), policy=self.policy(), storage=self.storage,
                         namespace=self.namespace)

    def engine(self, store=None, config=None):
        """The read path's BlendEngine over the same keys (``config``: a BlendConfig)."""
        from ragkv.blend import BlendEngine

        return BlendEngine(*self._load(), self._store(store), config, policy=self.policy(),
                           storage=self.storage, namespace=self.namespace)

    def _load(self):
        from ragkv import models

        return models.load(self.model, dtype=self.model_dtype)

    def _store(self, store):
        from ragkv.store import open_store

        return open_store(self.store_uri) if store is None else store
