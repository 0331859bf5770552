"""Normalization components with their plan fragments: RMS norms (``rms_norm``), layer norms and the per-head layer
norm style (``layer_norm``), and OLMo 2's RMS norm over whole head-split projections (``full_width_norm``)."""
