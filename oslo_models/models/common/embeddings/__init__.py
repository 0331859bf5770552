"""Positions and embedding tables: rotary embeddings (``rotary``), learned absolute positions and ALiBi
(``positions``), and ``resize_token_embeddings`` of vocab-parallel tables (``resize``)."""
