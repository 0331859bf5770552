"""Checkpoint keys and loading options: per-expert keys <-> stacked experts (``expert_keys``), old ``gamma``/``beta``
LayerNorm names (``legacy_keys``), keys ``transformers`` renames on load and save (``renamed_keys``), and what
``from_pretrained``'s keyword arguments mean for a parallel model (``pretrained_options``)."""
