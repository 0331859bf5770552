"""T5ForConditionalGeneration (and mT5) as pipeline stages: the encoder-decoder stages every family shares
(``common/pipeline/pipeline_seq2seq.py``: layers ``encoder.block`` then ``decoder.block``, cut anywhere; both stacks'
phases on each stage's blocks) with T5's parts.

Stage modules: the first stage ``shared`` and both stacks' input dropout; the stage with encoder block ``E-1``
``encoder.final_layer_norm`` + dropout; the last one ``decoder.final_layer_norm`` + dropout, the ``d_model**-0.5``
rescale of tied heads (``scale_decoder_outputs``, original T5) and ``lm_head`` (vocab-parallel logits). ``lm_head`` is
tied to ``shared`` while the checkpoint's head equals it (original T5); T5 v1.1's own head is no copy.

Each stack's relative position bias ``[1, n/tp, s, s]`` is computed by its block 0 and travels as an activation, so
later stages reuse it and its gradient flows back to block 0's ``relative_attention_bias``; the cross-attention bias
(zeros, no parameters) is recomputed by each stage. Parameter counts per layer come from the stacks built on the
meta device with no parallelism, not from formulas.
"""
from __future__ import annotations

import torch

from ...distributed.context import ParallelContext
from ..common.pipeline.pipeline_seq2seq import EncoderDecoderPipelineAdapter


class T5PipelineAdapter(EncoderDecoderPipelineAdapter):
    layer_paths = ("encoder.block", "decoder.block")

    def layer_counts(self, model) -> tuple[int, ...]:
        return model.config.num_layers, model.config.num_decoder_layers

    def layer_parameter_counts(self, model) -> tuple[list[float], float, float]:
        """Blocks (decoder blocks with cross-attention, blocks 0 with the position bias; the last encoder layer
        also counts the encoder's final norm); ``shared`` on the first stage; the head (a full ``V x d`` even when
        tied: the last stage holds a copy) and the decoder's final norm on the last."""
        from .modeling_t5 import T5Stack, _stack_config

        stack_class = getattr(model, "stack_class", T5Stack)  # ``model`` may be transformers' own (tests)
        with torch.device("meta"):
            context = ParallelContext.single_process()
            encoder, decoder = (stack_class(_stack_config(model.config, is_decoder=is_decoder),
                                            parallel_context=context) for is_decoder in (False, True))

        def count(module) -> float:
            return float(sum(p.numel() for p in module.parameters()))

        encoder_costs = [count(block) for block in encoder.block]
        encoder_costs[-1] += count(encoder.final_layer_norm)
        embedding = count(encoder.embed_tokens)
        return (encoder_costs + [count(block) for block in decoder.block], embedding,
                embedding + count(decoder.final_layer_norm))

    def stage_modules(self, model, layout, stage: int) -> dict[str, str]:
        layers, num_encoder = layout.ranges[stage], model.config.num_layers
        modules = {}
        if stage == 0:
            modules.update(shared="shared", encoder_dropout="encoder.dropout", decoder_dropout="decoder.dropout")
        if num_encoder - 1 in layers:
            modules.update(encoder_final_layer_norm="encoder.final_layer_norm", encoder_dropout="encoder.dropout")
        if stage == layout.num_stages - 1:
            modules.update(decoder_final_layer_norm="decoder.final_layer_norm", decoder_dropout="decoder.dropout",
                           lm_head="lm_head")
        return modules

    def head_tied(self, model) -> bool:
        return getattr(model, "_lm_head_tied", True)

    def whole_backward_stages(self, model, layout) -> set[int]:
        """The stage with decoder block 0, unless it is the last: the position bias it sends on is computed from
        block 0's weights alone, which torch's split (zero-bubble) backward would miss."""
        stage = next(s for s, layers in enumerate(layout.ranges) if model.config.num_layers in layers)
        return {stage} if stage < layout.num_stages - 1 else set()

    # ------------------------------------------------------------------ hooks of the shared stages
    def shift(self, model, ids):
        return model._shift_right(ids)

    def bias_shape(self, model, seq_len):
        return 1, model.config.num_heads // model.parallel_context.tp_size, seq_len, seq_len

    def stacks(self, model):
        return model.encoder, model.decoder

    def decoder_inputs(self, decoder, like, decoder_attention_mask, encoder_output, attention_mask,
                       sequence_parallel):
        return decoder.stack_inputs(like, decoder_attention_mask, encoder_output, attention_mask,
                                    sequence_parallel=sequence_parallel), {}

    def run(self, stack, hidden, inputs, blocks, last, bias, **kwargs):
        return stack.run_stack(hidden, inputs, blocks=blocks, first=hidden is None, last=last, position_bias=bias,
                               **kwargs)

    def head_forward(self, stage, hidden):
        if stage.model_config.scale_decoder_outputs:  # original T5 (tied head) rescales before the projection
            hidden = hidden * (stage.model_config.d_model ** -0.5)
        return stage.lm_head(hidden)  # [mb, s_dec, V_padded/tp]
