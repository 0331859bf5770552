"""Attention over this rank's heads and what it reads: the shared multi-head helpers and the grouped-query attention
of the Llama-shaped decoders (``attention``), its variants (``attention_variants``: sinks, full-width q/k norms, packed
q|k|v), the packed-per-head (``packed_attention``), grouped fused-qkv (``grouped_qkv_attention``), latent
(``latent_attention``), disentangled (``disentangled_attention``) and cross (``cross_attention``) attentions, the
decoders' and encoders' masks (``causal_masks``, ``encoder_masks``) and the cache's name in ``transformers``
(``cache_names``)."""
