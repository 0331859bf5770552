"""Heads' losses: the token loss and logits of a vocab-parallel output layer (``lm_loss``) and one rule per task head,
run by a model's ``forward`` and by a pipeline's last stage alike (``head_rules``)."""
