"""BART's heads as pipeline stages: the encoder-decoder stages every family shares
(``common/pipeline/pipeline_seq2seq.py``: layers ``model.encoder.layers`` then ``model.decoder.layers``, cut anywhere;
both stacks' phases on each stage's layers) with BART's parts.

Stage modules: the first stage embeds both ``input_ids`` and ``decoder_input_ids`` with ``shared`` (times
``embed_scale``) and each stack's learned positions, ``layernorm_embedding`` and embedding dropout; the last one runs
the head: ``lm_head`` plus its vocabulary slice of ``final_logits_bias`` (a buffer every stage holds). BART has no
final norms, so the stage with encoder layer ``E-1`` only gathers the encoder output back to full length, and no
position bias travels between stages.

The other heads cut the same way; only the last stage's head differs, and their output shape, batch and loss are
the task rule's (``common/loss/head_rules.py``): ``classification_head`` on the decoder state at each row's last
``<eos>`` of ``input_ids`` (``eos_mask [mb, s]``, computed from the whole batch before the split and handed to every
stage, as the first stage alone receives ``input_ids``) -> ``[mb, num_labels]``, or ``qa_outputs`` on every decoder
state -> ``[mb, s_dec, 2]`` (the positions index the decoder sequence). Their decoder reads ``input_ids`` shifted
right unless the batch gives ``decoder_input_ids`` (as ``BartModel``), and no ``lm_head`` exists.
"""
from __future__ import annotations

import torch

from ...distributed.context import ParallelContext
from ..common.loss.head_rules import QUESTION_ANSWERING, SEQUENCE_CLASSIFICATION
from ..common.pipeline.pipeline_seq2seq import EncoderDecoderPipelineAdapter


class BartPipelineAdapter(EncoderDecoderPipelineAdapter):
    prefix = "model."
    layer_paths = ("model.encoder.layers", "model.decoder.layers")
    head_modules = {"lm_head": "lm_head"}  # the last stage's head: {attribute: module path}

    def layer_counts(self, model) -> tuple[int, ...]:
        return model.config.encoder_layers, model.config.decoder_layers

    def layer_parameter_counts(self, model) -> tuple[list[float], float, float]:
        """Layers (decoder layers with cross-attention); the embeddings (``shared``, both stacks' positions and
        ``layernorm_embedding``) on the first stage; the head (a full ``V x d`` even when tied) on the last."""
        from .modeling_bart import BartDecoder, BartEncoder

        with torch.device("meta"):
            context = ParallelContext.single_process()
            encoder, decoder = (cls(model.config, parallel_context=context) for cls in (BartEncoder, BartDecoder))

        def count(*modules) -> float:
            return float(sum(p.numel() for module in modules for p in module.parameters()))

        first = count(encoder.embed_tokens, *(getattr(stack, name) for stack in (encoder, decoder)
                                              for name in ("embed_positions", "layernorm_embedding")))
        return ([count(layer) for layer in encoder.layers] + [count(layer) for layer in decoder.layers], first,
                count(encoder.embed_tokens))

    def stage_modules(self, model, layout, stage: int) -> dict[str, str]:
        modules = {}
        if stage == 0:
            modules["shared"] = "model.shared"
            for stack in ("encoder", "decoder"):
                for name in ("embed_positions", "layernorm_embedding", "dropout"):
                    modules[f"{stack}_{name}"] = f"model.{stack}.{name}"
        if stage == layout.num_stages - 1:
            modules.update(self.head_modules)
        return modules

    def head_tied(self, model) -> bool:
        return model.config.tie_word_embeddings and "lm_head" in self.head_modules

    # ------------------------------------------------------------------ hooks of the shared stages
    def shift(self, model, ids):
        from transformers.models.bart.modeling_bart import shift_tokens_right

        return shift_tokens_right(ids, model.config.pad_token_id, model.config.decoder_start_token_id)

    def stacks(self, model):
        return model.model.encoder, model.model.decoder

    def embed(self, stage, stack, ids):
        return stage.shared(ids) * stack.embed_scale

    def decoder_inputs(self, decoder, like, decoder_attention_mask, encoder_output, attention_mask,
                       sequence_parallel):
        inputs = decoder.stack_inputs(like, decoder_attention_mask, sequence_parallel=sequence_parallel)
        if encoder_output is None:
            return inputs, {}
        return inputs, {"encoder_attention_mask": decoder.cross_attention_mask(like, attention_mask, encoder_output)}

    def run(self, stack, hidden, inputs, blocks, last, bias, **kwargs):
        return stack.run_stack(hidden, inputs, layers=blocks, first=hidden is None, last=last, **kwargs), None

    def head_forward(self, stage, hidden):
        return stage.owner.head_logits(hidden)  # [mb, s_dec, V_padded/tp], with final_logits_bias


class BartSequenceClassificationPipelineAdapter(BartPipelineAdapter):
    """``classification_head`` on the decoder state at each row's last ``<eos>`` -> ``[mb, num_labels]``."""

    head_modules = {"classification_head": "classification_head"}
    rule = SEQUENCE_CLASSIFICATION

    def prepare_batch(self, model, batch):
        from .heads_bart import eos_positions

        batch = super().prepare_batch(model, batch)
        batch["eos_mask"] = eos_positions(batch["input_ids"], model.config.eos_token_id)  # checked on the batch
        return batch

    def head_forward(self, stage, hidden, eos_mask=None):
        from .heads_bart import last_eos_state

        return stage.classification_head(last_eos_state(hidden, eos_mask))


class BartQuestionAnsweringPipelineAdapter(BartPipelineAdapter):
    """``qa_outputs`` on every decoder state -> ``[mb, s_dec, 2]``."""

    head_modules = {"qa_outputs": "qa_outputs"}
    rule = QUESTION_ANSWERING
    batch_keys = BartPipelineAdapter.batch_keys + QUESTION_ANSWERING.extra_batch_keys

    def head_forward(self, stage, hidden):
        return stage.qa_outputs(hidden)
