"""Content-addressed chunk K/V storage: entry codec, backends, tiers."""
