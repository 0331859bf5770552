"""Feed-forward blocks: the dense MLPs (``mlp``: T5's, SwiGLU ``GatedMLP``, ``DenseMLP``, Phi-3's ``PackedGatedMLP``),
the bias + activation kernel they call (``bias_act``), the sparse mixture-of-experts block (``moe``) and its router /
expert variants (``moe_variants``)."""
