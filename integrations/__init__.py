"""ragkv.integrations: HuggingFace generate wrapper and LlamaIndex components.

    ragkv.integrations.hf           BlendedGenerator: generate(question, contexts, **generate_kwargs)
    ragkv.integrations.llama_index  RagKVNodePostprocessor, RagKVSynthesizer, RagKVLLM, FaissRetriever,
                                    nodes_from_documents (needs llama-index-core; faiss-cpu for the retriever)
    ragkv.integrations.embeddings   MiniLMEmbedding: local all-MiniLM-L6-v2 as a LlamaIndex embedding

Imports point one way: integrations -> ragkv core; the core never imports this package.
"""
