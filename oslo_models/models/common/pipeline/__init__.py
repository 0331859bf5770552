"""Pipeline stages shared by the families: the decoders' (``pipeline_stack``, derived from the ``StackSpec``), the
encoders' (``pipeline_encoder``) and the encoder-decoders' (``pipeline_seq2seq``)."""
