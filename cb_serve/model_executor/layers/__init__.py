"""The pieces every model is built from: norms, rotary embeddings, activations, the vocabulary-
parallel embedding, the gated MLP and an attention layer configured per layer."""
