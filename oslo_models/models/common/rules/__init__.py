"""What a class declares and the validation reads: the per-class ``Capabilities`` record (``capabilities``), the
components' divisibility rules (``parallel_rules``) and the ``base_model_tp_plan`` a config class publishes from its
family's spec (``published_plan``)."""
