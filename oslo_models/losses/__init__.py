"""Vocabulary-parallel primitives for post-training losses: log-probabilities, entropy, KL, top-k.

Every function takes this rank's slice of an LM head's logits, ``[..., V_padded/tp]`` (a ``ColumnParallelLinear``
over a vocabulary padded to a multiple of ``tp``; padded columns ``-inf``), and the split as a :class:`VocabShard`
(``VocabShard.of(model)``). Each is exact against the single-process computation on the whole vocabulary, walks
the tokens in chunks (no ``[tokens, vocab]`` fp32 tensor is whole), runs a fixed number of all-reduces over the
tensor-parallel group in its forward and none in its backward (each file's docstring names them):

    shard = om.losses.VocabShard.of(model)
    logits = model(input_ids, gather_logits=False).logits[:, :-1]          # [b, s-1, V_padded/tp]
    logp = om.losses.token_log_probs(logits, input_ids[:, 1:], shard=shard)  # [b, s-1] fp32
    kl = om.losses.kl_divergence(logits, teacher_logits, direction="reverse", shard=shard)

| function               | what                                                   | forward collectives           |
|------------------------|--------------------------------------------------------|-------------------------------|
| ``token_log_probs``    | log p(target) per token (``-100``: 0)                  | MAX ``[1, n]``, SUM ``[5, n]`` |
| ``token_entropy``      | entropy per token                                      | MAX ``[1, n]``, SUM ``[5, n]`` |
| ``token_statistics``   | the above + TRL's logged fields, one pass              | MAX ``[2, n]``, SUM ``[5, n]`` |
| ``kl_divergence``      | KL(teacher||student) / KL(student||teacher), full      | MAX ``[2, n]``, SUM ``[3, n]`` |
| ``topk_kl_divergence`` | the same against a teacher's top-k logits and ids      | MAX ``[n]``, SUM ``[n, k+1]``  |
| ``topk_logits``        | the k largest logits and their ids                     | 2 all-gathers ``[n, k]``      |
"""
from .divergence import kl_divergence
from .entropy import token_entropy
from .log_probs import token_log_probs
from .token_statistics import FIELDS, token_statistics
from .topk import topk_logits
from .topk_divergence import topk_kl_divergence
from .vocab_shard import VocabShard

__all__ = ["FIELDS", "VocabShard", "kl_divergence", "token_entropy", "token_log_probs", "token_statistics",
           "topk_kl_divergence", "topk_logits"]
