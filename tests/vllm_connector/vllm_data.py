"""Short documents the connector tests ask about (facts SmolLM2 does not know), and the dtype they run in."""

DTYPE = "float32"  # this CPU has no native bf16 (no AVX512-BF16/AMX): fp32 is vLLM's fast dtype here

DOCS = [
    "The lighthouse at Kerran Point was built in 1871 by the engineer Ada Morrow. Its lamp was converted "
    "to electricity in 1932 and automated in 1988.",
    "Kerran Point lies on the north coast, twelve miles from the harbour town of Vell. The headland is "
    "known for puffins in early summer.",
    "Ferries to Vell leave twice a day in summer and once a day in winter, from the old pier.",
    "The Vell museum keeps the lighthouse's first lens, a Fresnel lens made in Paris.",
]

BLOCK = 32  # vLLM's block size in the tests
# vLLM's chunked-prefill budget in the tests (tokens per step): below one block, so even the last
# partial block a blended prompt leaves to vLLM is prefilled over several steps, and so is every
# prompt vLLM prefills itself
MAX_BATCHED_TOKENS = 16
# a system prompt of several blocks that many prompts share: vLLM's prefix cache holds it
SYSTEM = ("You are the archivist of the Vell harbour museum. Answer questions about the coast, its "
          "lighthouse and its ferries from the documents the user gives you, in one short sentence. "
          "If the documents do not say, answer that you do not know. Never invent names or dates, "
          "and quote numbers exactly as the documents give them.")
