"""The shared stack and what runs around its layers: ``TransformerStack`` and ``StackSpec`` (``stack``), the spec's
parts (``stack_parts``), the block templates (``blocks``), the encoders' stack (``encoder_stack``), the
sequence- and context-parallel boundaries of a forward (``sequence_parallel``, ``context_parallel``), activation
checkpointing (``checkpointing``), the long-sequence memory options (``long_sequence``) and the recorded outputs
(``outputs``)."""
